//! The inverse of the decoder: for round-trip tests, and for other crates' tests
//! through [`crate::test_util`] (feature `test-util`).

use bytes::{BufMut, Bytes, BytesMut};

use crate::change::OldTuple;
use crate::message::LogicalMessage;
use crate::relation::ReplicaIdentity;
use crate::text::Text;
use crate::tuple::TupleData;

/// A column value to encode.
#[cfg(test)]
#[derive(Clone, Debug)]
pub(crate) enum Value {
    Null,
    Toast,
    Text(Vec<u8>),
    Binary(Vec<u8>),
}

#[cfg(test)]
pub(crate) fn tuple(values: &[Value]) -> TupleData {
    let mut b = BytesMut::new();
    for v in values {
        match v {
            Value::Null => b.put_u8(b'n'),
            Value::Toast => b.put_u8(b'u'),
            Value::Text(t) | Value::Binary(t) => {
                b.put_u8(if matches!(v, Value::Text(_)) {
                    b't'
                } else {
                    b'b'
                });
                b.put_u32(t.len() as u32);
                b.put_slice(t);
            }
        }
    }
    TupleData::from_raw(values.len() as u16, b.freeze())
}

fn cstr(b: &mut BytesMut, t: &Text) {
    b.put_slice(t.as_bytes());
    b.put_u8(0);
}

fn put_tuple(b: &mut BytesMut, t: &TupleData) {
    b.put_u16(t.count);
    b.put_slice(&t.data);
}

fn xid(b: &mut BytesMut, x: Option<u32>) {
    if let Some(x) = x {
        b.put_u32(x);
    }
}

pub(crate) fn encode(m: &LogicalMessage) -> Bytes {
    let mut b = BytesMut::new();
    b.put_u8(m.tag());
    match m {
        LogicalMessage::Begin(x) => {
            b.put_u64(x.final_lsn.as_u64());
            b.put_i64(x.commit_time.as_pg_micros());
            b.put_u32(x.xid);
        }
        LogicalMessage::Commit(x) => {
            b.put_u8(x.flags);
            b.put_u64(x.commit_lsn.as_u64());
            b.put_u64(x.end_lsn.as_u64());
            b.put_i64(x.commit_time.as_pg_micros());
        }
        LogicalMessage::Origin(x) => {
            b.put_u64(x.commit_lsn.as_u64());
            cstr(&mut b, &x.name);
        }
        LogicalMessage::Relation(x) => {
            xid(&mut b, x.xid);
            b.put_u32(x.oid);
            cstr(&mut b, &x.namespace);
            cstr(&mut b, &x.name);
            b.put_u8(match x.replica_identity {
                ReplicaIdentity::Default => b'd',
                ReplicaIdentity::Nothing => b'n',
                ReplicaIdentity::Full => b'f',
                ReplicaIdentity::Index => b'i',
            });
            b.put_u16(x.columns.len() as u16);
            for c in &x.columns {
                b.put_u8(c.flags);
                cstr(&mut b, &c.name);
                b.put_u32(c.type_oid);
                b.put_i32(c.type_modifier);
            }
        }
        LogicalMessage::Type(x) => {
            xid(&mut b, x.xid);
            b.put_u32(x.oid);
            cstr(&mut b, &x.namespace);
            cstr(&mut b, &x.name);
        }
        LogicalMessage::Insert(x) => {
            xid(&mut b, x.xid);
            b.put_u32(x.relation_oid);
            b.put_u8(b'N');
            put_tuple(&mut b, &x.tuple);
        }
        LogicalMessage::Update(x) => {
            xid(&mut b, x.xid);
            b.put_u32(x.relation_oid);
            match &x.old {
                Some(OldTuple::Key(t)) => {
                    b.put_u8(b'K');
                    put_tuple(&mut b, t);
                }
                Some(OldTuple::Full(t)) => {
                    b.put_u8(b'O');
                    put_tuple(&mut b, t);
                }
                None => {}
            }
            b.put_u8(b'N');
            put_tuple(&mut b, &x.new);
        }
        LogicalMessage::Delete(x) => {
            xid(&mut b, x.xid);
            b.put_u32(x.relation_oid);
            let (marker, t) = match &x.old {
                OldTuple::Key(t) => (b'K', t),
                OldTuple::Full(t) => (b'O', t),
            };
            b.put_u8(marker);
            put_tuple(&mut b, t);
        }
        LogicalMessage::Truncate(x) => {
            xid(&mut b, x.xid);
            b.put_u32(x.relation_oids.len() as u32);
            b.put_u8(x.options);
            for oid in &x.relation_oids {
                b.put_u32(*oid);
            }
        }
        LogicalMessage::Message(x) => {
            xid(&mut b, x.xid);
            b.put_u8(x.flags);
            b.put_u64(x.lsn.as_u64());
            cstr(&mut b, &x.prefix);
            b.put_u32(x.content.len() as u32);
            b.put_slice(&x.content);
        }
        LogicalMessage::StreamStart(x) => {
            b.put_u32(x.xid);
            b.put_u8(u8::from(x.first_segment));
        }
        LogicalMessage::StreamStop => {}
        LogicalMessage::StreamCommit(x) => {
            b.put_u32(x.xid);
            b.put_u8(x.flags);
            b.put_u64(x.commit_lsn.as_u64());
            b.put_u64(x.end_lsn.as_u64());
            b.put_i64(x.commit_time.as_pg_micros());
        }
        LogicalMessage::StreamAbort(x) => {
            b.put_u32(x.xid);
            b.put_u32(x.subxid);
            if let Some((lsn, t)) = x.abort {
                b.put_u64(lsn.as_u64());
                b.put_i64(t.as_pg_micros());
            }
        }
        LogicalMessage::BeginPrepare(x) => {
            b.put_u64(x.prepare_lsn.as_u64());
            b.put_u64(x.end_lsn.as_u64());
            b.put_i64(x.prepare_time.as_pg_micros());
            b.put_u32(x.xid);
            cstr(&mut b, &x.gid);
        }
        LogicalMessage::Prepare(x) | LogicalMessage::StreamPrepare(x) => {
            b.put_u8(x.flags);
            b.put_u64(x.prepare_lsn.as_u64());
            b.put_u64(x.end_lsn.as_u64());
            b.put_i64(x.prepare_time.as_pg_micros());
            b.put_u32(x.xid);
            cstr(&mut b, &x.gid);
        }
        LogicalMessage::CommitPrepared(x) => {
            b.put_u8(x.flags);
            b.put_u64(x.commit_lsn.as_u64());
            b.put_u64(x.end_lsn.as_u64());
            b.put_i64(x.commit_time.as_pg_micros());
            b.put_u32(x.xid);
            cstr(&mut b, &x.gid);
        }
        LogicalMessage::RollbackPrepared(x) => {
            b.put_u8(x.flags);
            b.put_u64(x.prepare_end_lsn.as_u64());
            b.put_u64(x.rollback_end_lsn.as_u64());
            b.put_i64(x.prepare_time.as_pg_micros());
            b.put_i64(x.rollback_time.as_pg_micros());
            b.put_u32(x.xid);
            cstr(&mut b, &x.gid);
        }
    }
    b.freeze()
}
