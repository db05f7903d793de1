//! Decoding a realistic stream of outbox Inserts: XLogData frames of ~230
//! bytes (205-byte Inserts of 7 text columns: uuid, aggregate type/id, event type, a JSON payload,
//! headers, timestamp), decoded and mapped the way the relay reads them.
//!
//! `cargo bench -p pgoutput-decoder` — reports Insert messages per second.

#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn

use bytes::{BufMut, Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use pgoutput_decoder::{Decoder, LogicalMessage, RelationCache, ReplicationMessage};

const OID: u32 = 16_390;
const FRAMES: usize = 10_000;

fn xlogdata(payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(25 + payload.len());
    b.put_u8(b'w');
    b.put_u64(0x1_0000_0000);
    b.put_u64(0x1_0000_1000);
    b.put_i64(815_000_000_000_000);
    b.put_slice(payload);
    b.freeze()
}

fn relation() -> Bytes {
    let mut b = BytesMut::new();
    b.put_u8(b'R');
    b.put_u32(OID);
    b.put_slice(b"public\0outbox_events\0d");
    let cols: [(&str, u32); 7] = [
        ("id", 2950),
        ("aggregate_type", 25),
        ("aggregate_id", 25),
        ("event_type", 25),
        ("payload", 3802),
        ("headers", 3802),
        ("created_at", 1184),
    ];
    b.put_u16(cols.len() as u16);
    for (i, (name, oid)) in cols.iter().enumerate() {
        b.put_u8(u8::from(i == 0));
        b.put_slice(name.as_bytes());
        b.put_u8(0);
        b.put_u32(*oid);
        b.put_i32(-1);
    }
    xlogdata(&b)
}

fn insert(n: usize) -> Bytes {
    let values = [
        format!("6d1f1c9e-{:04x}-4000-8000-{:012x}", n % 0xffff, n),
        "order".to_owned(),
        format!("order-{}", n % 1000),
        "OrderCreated".to_owned(),
        format!(
            r#"{{"order_id": "order-{}", "total": {}, "currency": "EUR", "lines": 3}}"#,
            n % 1000,
            n % 997
        ),
        "{}".to_owned(),
        "2026-11-21 17:00:00.123456+00".to_owned(),
    ];
    let mut b = BytesMut::new();
    b.put_u8(b'I');
    b.put_u32(OID);
    b.put_u8(b'N');
    b.put_u16(values.len() as u16);
    for v in &values {
        b.put_u8(b't');
        b.put_u32(v.len() as u32);
        b.put_slice(v.as_bytes());
    }
    xlogdata(&b)
}

fn bench(c: &mut Criterion) {
    let frames: Vec<Bytes> = (0..FRAMES).map(insert).collect();
    let avg = frames.iter().map(Bytes::len).sum::<usize>() / FRAMES;
    println!(
        "frame size: {avg} bytes on average ({} bytes of pgoutput message)",
        avg - 25
    );

    let mut group = c.benchmark_group("outbox_inserts");
    group.throughput(Throughput::Elements(FRAMES as u64));

    group.bench_function("decode", |b| {
        b.iter_batched_ref(
            || frames.clone(),
            |frames| {
                let mut decoder = Decoder::new(1).unwrap();
                let mut n = 0usize;
                for frame in frames.drain(..) {
                    let ReplicationMessage::XLogData(x) = ReplicationMessage::parse(frame).unwrap()
                    else {
                        unreachable!()
                    };
                    if let LogicalMessage::Insert(i) = decoder.decode(x.into_data()).unwrap() {
                        n += i.tuple().len();
                    }
                }
                n
            },
            BatchSize::LargeInput,
        )
    });

    // Decode, resolve the relation, and read what the relay maps: id,
    // aggregate type and id, event type as &str, the payload as a zero-copy slice.
    let mut cache = RelationCache::new();
    let ReplicationMessage::XLogData(x) = ReplicationMessage::parse(relation()).unwrap() else {
        unreachable!()
    };
    let LogicalMessage::Relation(r) = Decoder::new(1).unwrap().decode(x.into_data()).unwrap()
    else {
        unreachable!()
    };
    cache.insert(r);
    group.bench_function("decode_and_map", |b| {
        b.iter_batched_ref(
            || frames.clone(),
            |frames| {
                let mut decoder = Decoder::new(1).unwrap();
                let mut bytes = 0usize;
                for frame in frames.drain(..) {
                    let ReplicationMessage::XLogData(x) = ReplicationMessage::parse(frame).unwrap()
                    else {
                        unreachable!()
                    };
                    let LogicalMessage::Insert(i) = decoder.decode(x.into_data()).unwrap() else {
                        unreachable!()
                    };
                    let row = cache.resolve(i.relation_oid(), i.tuple()).unwrap();
                    let mut id = "";
                    let mut topic = "";
                    let mut key = "";
                    let mut event_type = "";
                    let mut payload = None;
                    for (index, (name, value)) in row.iter().enumerate() {
                        match name {
                            "id" => id = value.as_str().unwrap(),
                            "aggregate_type" => topic = value.as_str().unwrap(),
                            "aggregate_id" => key = value.as_str().unwrap(),
                            "event_type" => event_type = value.as_str().unwrap(),
                            "payload" => payload = i.tuple().value_bytes(index),
                            _ => {}
                        }
                    }
                    bytes += id.len()
                        + topic.len()
                        + key.len()
                        + event_type.len()
                        + payload.map_or(0, |p| p.len());
                }
                bytes
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
