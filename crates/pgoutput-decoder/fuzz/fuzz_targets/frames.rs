//! Fuzzes the replication frame decoder and the stateful pgoutput decoder.
//!
//! Input: one configuration byte (protocol version 1–4 in the low bits,
//! parallel streaming in bit 2), then frames, each a big-endian u16 length and
//! that many bytes of CopyData payload. Every frame goes through
//! `ReplicationMessage::parse`; XLogData payloads through one `Decoder` (so
//! stream state carries across frames), Relations into a `RelationCache`, and
//! every Insert/Update/Delete tuple is resolved and each column read as text.
//! Any panic is a bug: malformed input must be an error.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use pgoutput_decoder::{Decoder, LogicalMessage, RelationCache, ReplicationMessage, TupleData};

fn touch(cache: &RelationCache, oid: u32, tuple: &TupleData) {
    for column in tuple {
        let _ = column.as_str();
    }
    if let Ok(row) = cache.resolve(oid, tuple) {
        for (name, value) in row.iter() {
            let _ = (name.len(), value.as_bytes());
        }
        let _ = row.text("aggregate_id");
    }
    let _ = tuple.value_bytes(tuple.len().saturating_sub(1));
}

fuzz_target!(|data: &[u8]| {
    let Some((&config, mut rest)) = data.split_first() else { return };
    let version = u32::from(config & 0b11) + 1;
    let mut decoder = Decoder::new(version).unwrap().with_parallel_streaming(config & 0b100 != 0);
    let mut cache = RelationCache::new();
    while rest.len() >= 2 {
        let len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
        let frame = &rest[2..];
        let frame = &frame[..len.min(frame.len())];
        rest = &rest[2 + frame.len()..];
        let Ok(ReplicationMessage::XLogData(x)) = ReplicationMessage::parse(Bytes::copy_from_slice(frame)) else {
            continue;
        };
        match decoder.decode(x.into_data()) {
            Ok(LogicalMessage::Relation(r)) => cache.insert(r),
            Ok(LogicalMessage::Insert(i)) => touch(&cache, i.relation_oid(), i.tuple()),
            Ok(LogicalMessage::Update(u)) => {
                if let Some(old) = u.old() {
                    touch(&cache, u.relation_oid(), old.tuple());
                }
                touch(&cache, u.relation_oid(), u.new_tuple());
            }
            Ok(LogicalMessage::Delete(d)) => touch(&cache, d.relation_oid(), d.old().tuple()),
            Ok(other) => {
                let _ = format!("{other:?}");
            }
            Err(e) => {
                let _ = e.to_string();
            }
        }
    }
});
