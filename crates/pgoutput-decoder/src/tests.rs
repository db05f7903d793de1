//! Per-message tests from hand-built bytes, malformed input, and round-trip
//! properties against the test-only encoder.

use bytes::{BufMut, Bytes, BytesMut};
use proptest::prelude::*;

use crate::change::*;
use crate::encode::{encode, tuple, Value};
use crate::error::DecodeErrorKind;
use crate::message::{Decoder, LogicalMessage};
use crate::relation::*;
use crate::text::Text;
use crate::time::PgTimestamp;
use crate::transaction::*;
use crate::tuple::Column;
use crate::{Lsn, RelationCache};

fn v(n: u32) -> Decoder {
    Decoder::new(n).unwrap()
}

/// A decoder positioned inside a streamed block of transaction `xid`.
fn streaming(version: u32, xid: u32) -> Decoder {
    let mut d = v(version);
    let mut b = BytesMut::new();
    b.put_u8(b'S');
    b.put_u32(xid);
    b.put_u8(1);
    d.decode(b.freeze()).unwrap();
    assert!(d.in_stream());
    d
}

fn outbox_relation() -> RelationBody {
    let col = |flags, name: &'static str, type_oid| RelationColumn {
        flags,
        name: Text::from_static(name),
        type_oid,
        type_modifier: -1,
    };
    RelationBody {
        xid: None,
        oid: 16_390,
        namespace: Text::from_static("public"),
        name: Text::from_static("outbox_events"),
        replica_identity: ReplicaIdentity::Default,
        columns: vec![
            col(1, "id", 2950),
            col(0, "aggregate_type", 25),
            col(0, "aggregate_id", 25),
            col(0, "event_type", 25),
            col(0, "payload", 3802),
            col(0, "headers", 3802),
            col(0, "created_at", 1184),
        ],
    }
}

fn outbox_insert(aggregate_id: &str) -> InsertBody {
    InsertBody {
        xid: None,
        relation_oid: 16_390,
        tuple: tuple(&[
            Value::Text(b"6d1f1c9e-0000-4000-8000-000000000001".to_vec()),
            Value::Text(b"order".to_vec()),
            Value::Text(aggregate_id.as_bytes().to_vec()),
            Value::Text(b"OrderCreated".to_vec()),
            Value::Text(br#"{"total": 42}"#.to_vec()),
            Value::Text(b"{}".to_vec()),
            Value::Text(b"2026-11-21 17:00:00.123456+00".to_vec()),
        ]),
    }
}

#[test]
fn begin_from_bytes() {
    let mut b = vec![b'B'];
    b.extend_from_slice(&0x0000_0001_0000_0100u64.to_be_bytes());
    b.extend_from_slice(&1_000_000i64.to_be_bytes());
    b.extend_from_slice(&777u32.to_be_bytes());
    let LogicalMessage::Begin(m) = v(1).decode(Bytes::from(b)).unwrap() else {
        panic!()
    };
    assert_eq!(m.final_lsn(), Lsn::new(0x1_0000_0100));
    assert_eq!(m.commit_time(), PgTimestamp::from_pg_micros(1_000_000));
    assert_eq!(m.xid(), 777);
}

#[test]
fn commit_from_bytes() {
    let mut b = vec![b'C', 0];
    b.extend_from_slice(&0x100u64.to_be_bytes());
    b.extend_from_slice(&0x130u64.to_be_bytes());
    b.extend_from_slice(&5i64.to_be_bytes());
    let LogicalMessage::Commit(m) = v(1).decode(Bytes::from(b)).unwrap() else {
        panic!()
    };
    assert_eq!(
        (m.flags(), m.commit_lsn(), m.end_lsn()),
        (0, Lsn::new(0x100), Lsn::new(0x130))
    );
    assert_eq!(m.commit_time().as_pg_micros(), 5);
}

#[test]
fn relation_and_insert_from_bytes_resolve_by_name() {
    let mut b = vec![b'R'];
    b.extend_from_slice(&16_390u32.to_be_bytes());
    b.extend_from_slice(b"public\0outbox_events\0d");
    b.extend_from_slice(&2i16.to_be_bytes());
    b.push(1);
    b.extend_from_slice(b"id\0");
    b.extend_from_slice(&2950u32.to_be_bytes());
    b.extend_from_slice(&(-1i32).to_be_bytes());
    b.push(0);
    b.extend_from_slice(b"payload\0");
    b.extend_from_slice(&3802u32.to_be_bytes());
    b.extend_from_slice(&(-1i32).to_be_bytes());
    let mut d = v(1);
    let LogicalMessage::Relation(rel) = d.decode(Bytes::from(b)).unwrap() else {
        panic!()
    };
    assert_eq!(
        (rel.oid(), rel.namespace(), rel.name()),
        (16_390, "public", "outbox_events")
    );
    assert_eq!(rel.replica_identity(), ReplicaIdentity::Default);
    assert_eq!(rel.columns().len(), 2);
    assert!(rel.columns()[0].is_key() && !rel.columns()[1].is_key());
    assert_eq!(
        (rel.columns()[1].name(), rel.columns()[1].type_oid()),
        ("payload", 3802)
    );
    assert_eq!(rel.columns()[1].type_modifier(), -1);

    let mut b = vec![b'I'];
    b.extend_from_slice(&16_390u32.to_be_bytes());
    b.push(b'N');
    b.extend_from_slice(&2i16.to_be_bytes());
    b.push(b't');
    b.extend_from_slice(&3u32.to_be_bytes());
    b.extend_from_slice(b"abc");
    b.push(b'n');
    let frame = Bytes::from(b);
    let base = frame.as_ptr() as usize;
    let LogicalMessage::Insert(ins) = d.decode(frame).unwrap() else {
        panic!()
    };
    assert_eq!((ins.xid(), ins.relation_oid()), (None, 16_390));
    let cols: Vec<Column<'_>> = ins.tuple().iter().collect();
    assert_eq!(cols, vec![Column::Text(b"abc"), Column::Null]);
    let value = ins.tuple().value_bytes(0).unwrap();
    assert_eq!(value.as_ptr() as usize, base + 13, "value shares the frame");

    let mut cache = RelationCache::new();
    cache.insert(rel);
    let row = cache.resolve(ins.relation_oid(), ins.tuple()).unwrap();
    assert_eq!(row.text("id"), Some("abc"));
    assert_eq!(row.column("payload"), Some(Column::Null));
    assert_eq!(row.text("payload"), None);
    assert_eq!(row.column("nope"), None);
    let names: Vec<&str> = row.iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["id", "payload"]);
    assert!(cache.resolve(1, ins.tuple()).is_err());
}

#[test]
fn resolve_rejects_a_tuple_of_the_wrong_shape() {
    let mut cache = RelationCache::new();
    cache.insert(outbox_relation());
    let short = tuple(&[Value::Null]);
    let e = cache.resolve(16_390, &short).unwrap_err();
    assert_eq!(
        e.to_string(),
        "tuple of public.outbox_events has 1 columns, its Relation message declares 7"
    );
}

#[test]
fn update_variants_from_bytes() {
    let t = |b: &mut Vec<u8>| {
        b.extend_from_slice(&1i16.to_be_bytes());
        b.push(b'u');
    };
    for (marker, expect_old) in [(None, false), (Some(b'K'), true), (Some(b'O'), true)] {
        let mut b = vec![b'U'];
        b.extend_from_slice(&9u32.to_be_bytes());
        if let Some(m) = marker {
            b.push(m);
            t(&mut b);
        }
        b.push(b'N');
        t(&mut b);
        let LogicalMessage::Update(u) = v(1).decode(Bytes::from(b)).unwrap() else {
            panic!()
        };
        assert_eq!(u.old().is_some(), expect_old);
        assert!(matches!(
            (marker, u.old()),
            (None, None)
                | (Some(b'K'), Some(OldTuple::Key(_)))
                | (Some(b'O'), Some(OldTuple::Full(_)))
        ));
        assert_eq!(u.new_tuple().get(0), Some(Column::UnchangedToast));
    }
}

#[test]
fn truncate_and_message_from_bytes() {
    let mut b = vec![b'T'];
    b.extend_from_slice(&2i32.to_be_bytes());
    b.push(3);
    b.extend_from_slice(&10u32.to_be_bytes());
    b.extend_from_slice(&11u32.to_be_bytes());
    let LogicalMessage::Truncate(t) = v(1).decode(Bytes::from(b)).unwrap() else {
        panic!()
    };
    assert_eq!(t.relation_oids(), &[10, 11]);
    assert!(t.cascade() && t.restart_identity());

    let mut b = vec![b'M', 1];
    b.extend_from_slice(&0x55u64.to_be_bytes());
    b.extend_from_slice(b"walbox\0");
    b.extend_from_slice(&3i32.to_be_bytes());
    b.extend_from_slice(&[0xff, 0x00, 0xfe]);
    let LogicalMessage::Message(m) = v(1).decode(Bytes::from(b)).unwrap() else {
        panic!()
    };
    assert!(m.transactional());
    assert_eq!((m.lsn(), m.prefix()), (Lsn::new(0x55), "walbox"));
    assert_eq!(
        &m.content()[..],
        &[0xff, 0x00, 0xfe],
        "binary content is bytes"
    );
}

#[test]
fn streamed_messages_carry_the_xid_only_inside_a_stream() {
    let insert = LogicalMessage::Insert(InsertBody {
        xid: Some(4242),
        ..outbox_insert("o-1")
    });
    let bytes = encode(&insert);
    let mut d = streaming(2, 4242);
    assert_eq!(d.decode(bytes.clone()).unwrap(), insert);
    // Outside a stream, the same bytes do not parse as an Insert (the xid is read as the OID…).
    let e = v(2).decode(bytes).unwrap_err();
    assert!(
        matches!(e.kind(), DecodeErrorKind::UnexpectedMarker { .. }),
        "{e}"
    );

    assert_eq!(
        d.decode(Bytes::from_static(b"E")).unwrap(),
        LogicalMessage::StreamStop
    );
    assert!(!d.in_stream());
}

#[test]
fn stream_abort_carries_lsn_and_time_only_with_v4_parallel_streaming() {
    let mut b = vec![b'A'];
    b.extend_from_slice(&7u32.to_be_bytes());
    b.extend_from_slice(&8u32.to_be_bytes());
    let short = Bytes::from(b.clone());
    b.extend_from_slice(&0x99u64.to_be_bytes());
    b.extend_from_slice(&3i64.to_be_bytes());
    let long = Bytes::from(b);

    let LogicalMessage::StreamAbort(a) = v(2).decode(short.clone()).unwrap() else {
        panic!()
    };
    assert_eq!((a.xid(), a.subxid(), a.abort_lsn()), (7, 8, None));
    let LogicalMessage::StreamAbort(a) = v(4).decode(short.clone()).unwrap() else {
        panic!()
    };
    assert_eq!(a.abort_lsn(), None);
    let mut parallel = v(4).with_parallel_streaming(true);
    let LogicalMessage::StreamAbort(a) = parallel.decode(long.clone()).unwrap() else {
        panic!()
    };
    assert_eq!(
        (a.abort_lsn(), a.abort_time()),
        (Some(Lsn::new(0x99)), Some(PgTimestamp::from_pg_micros(3)))
    );
    // v4 parallel expects the extra fields; v2 rejects them as trailing bytes.
    assert!(matches!(
        parallel.decode(short).unwrap_err().kind(),
        DecodeErrorKind::Truncated { .. }
    ));
    assert_eq!(
        v(2).decode(long).unwrap_err().kind(),
        &DecodeErrorKind::TrailingBytes(16)
    );
}

#[test]
fn two_phase_messages_from_bytes() {
    let mut b = vec![b'K', 0];
    b.extend_from_slice(&1u64.to_be_bytes());
    b.extend_from_slice(&2u64.to_be_bytes());
    b.extend_from_slice(&3i64.to_be_bytes());
    b.extend_from_slice(&4u32.to_be_bytes());
    b.extend_from_slice(b"gid-1\0");
    let LogicalMessage::CommitPrepared(c) = v(3).decode(Bytes::from(b.clone())).unwrap() else {
        panic!()
    };
    assert_eq!(
        (c.commit_lsn(), c.end_lsn(), c.xid(), c.gid()),
        (Lsn::new(1), Lsn::new(2), 4, "gid-1")
    );
    // Not part of v1/v2.
    let e = v(2).decode(Bytes::from(b)).unwrap_err();
    assert_eq!(
        e.kind(),
        &DecodeErrorKind::NotInVersion {
            version: 2,
            needs: 3
        }
    );
    assert_eq!(e.to_string(), "malformed Commit Prepared at byte 0: not part of pgoutput protocol version 2 (needs 3 or later)");
}

#[test]
fn malformed_messages_are_errors_with_offsets() {
    let mut d = v(4);
    let check = |d: &mut Decoder, bytes: &[u8], offset: usize, kind: DecodeErrorKind| {
        let e = d.decode(Bytes::copy_from_slice(bytes)).unwrap_err();
        assert_eq!((e.offset(), e.kind()), (offset, &kind), "{e}");
    };
    check(&mut d, b"", 0, DecodeErrorKind::Empty);
    check(&mut d, b"Z", 0, DecodeErrorKind::UnknownTag('Z'));
    // Truncated Begin: 8 of 20 field bytes.
    check(
        &mut d,
        b"B\0\0\0\0\0\0\0\x01\0\0",
        9,
        DecodeErrorKind::Truncated {
            expected: "commit timestamp",
            need: 8,
            have: 2,
        },
    );
    // Negative value length in a tuple.
    let mut b = vec![b'I', 0, 0, 0, 1, b'N', 0, 1, b't'];
    b.extend_from_slice(&(-5i32).to_be_bytes());
    check(
        &mut d,
        &b,
        9,
        DecodeErrorKind::NegativeLength {
            length: -5,
            field: "tuple column value",
        },
    );
    // A length past the end: no allocation, an error.
    let mut b = vec![b'I', 0, 0, 0, 1, b'N', 0, 1, b't'];
    b.extend_from_slice(&i32::MAX.to_be_bytes());
    b.extend_from_slice(b"abc");
    check(
        &mut d,
        &b,
        13,
        DecodeErrorKind::Truncated {
            expected: "tuple column value",
            need: i32::MAX as usize,
            have: 3,
        },
    );
    // Negative column count.
    check(
        &mut d,
        &[b'I', 0, 0, 0, 1, b'N', 0xff, 0xff],
        6,
        DecodeErrorKind::NegativeLength {
            length: -1,
            field: "tuple column count",
        },
    );
    // Unknown column kind.
    check(
        &mut d,
        &[b'I', 0, 0, 0, 1, b'N', 0, 1, b'x'],
        8,
        DecodeErrorKind::UnknownColumnKind('x'),
    );
    // Wrong marker.
    check(
        &mut d,
        &[b'I', 0, 0, 0, 1, b'K', 0, 0],
        5,
        DecodeErrorKind::UnexpectedMarker {
            found: 'K',
            expected: "'N' (new tuple)",
        },
    );
    // Trailing bytes.
    check(
        &mut d,
        &[b'I', 0, 0, 0, 1, b'N', 0, 0, 0xAA],
        8,
        DecodeErrorKind::TrailingBytes(1),
    );
    // Unterminated and non-UTF-8 names.
    check(
        &mut d,
        b"O\0\0\0\0\0\0\0\x01origin",
        9,
        DecodeErrorKind::UnterminatedString("origin name"),
    );
    check(
        &mut d,
        b"O\0\0\0\0\0\0\0\x01\xff\xfe\0",
        9,
        DecodeErrorKind::InvalidUtf8("origin name"),
    );
    // A Relation claiming 32767 columns with none present: an error, and the
    // column vector was sized by the bytes present, not the claim.
    let mut b = vec![b'R', 0, 0, 0, 1];
    b.extend_from_slice(b"s\0t\0d");
    b.extend_from_slice(&i16::MAX.to_be_bytes());
    let e = d.decode(Bytes::from(b)).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            DecodeErrorKind::Truncated {
                expected: "column flags",
                ..
            }
        ),
        "{e}"
    );
    // A Truncate claiming 2^31-1 relations.
    let mut b = vec![b'T'];
    b.extend_from_slice(&i32::MAX.to_be_bytes());
    b.push(0);
    assert!(matches!(
        d.decode(Bytes::from(b)).unwrap_err().kind(),
        DecodeErrorKind::Truncated {
            expected: "relation OID",
            ..
        }
    ));
    // Error text names the message, offset and what was expected.
    let e = d.decode(Bytes::from_static(b"C\0")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "malformed Commit at byte 2: expected commit LSN (8 bytes), 0 remain"
    );
}

#[test]
fn a_failed_stream_start_does_not_change_the_stream_state() {
    let mut d = v(2);
    assert!(d.decode(Bytes::from_static(b"S\0\0")).is_err());
    assert!(!d.in_stream());
}

#[test]
fn versions_outside_one_to_four_are_refused() {
    assert!(Decoder::new(0).is_err());
    assert_eq!(
        Decoder::new(5).unwrap_err().to_string(),
        "unsupported pgoutput protocol version 5 (supported: 1 to 4)"
    );
}

// ---- properties -------------------------------------------------------------

fn text() -> impl Strategy<Value = Text> {
    "[a-zA-Z0-9_ .\"'é€-]{0,24}".prop_map(Text::from)
}

fn lsn() -> impl Strategy<Value = Lsn> {
    any::<u64>().prop_map(Lsn::new)
}

fn ts() -> impl Strategy<Value = PgTimestamp> {
    any::<i64>().prop_map(PgTimestamp::from_pg_micros)
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(Value::Toast),
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(Value::Text),
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(Value::Binary),
    ]
}

fn tuple_data() -> impl Strategy<Value = crate::TupleData> {
    proptest::collection::vec(value(), 0..12).prop_map(|vs| tuple(&vs))
}

fn old_tuple() -> impl Strategy<Value = OldTuple> {
    prop_oneof![
        tuple_data().prop_map(OldTuple::Key),
        tuple_data().prop_map(OldTuple::Full)
    ]
}

/// Any message, with `xid: Some` for data messages when `in_stream`.
fn message(in_stream: bool, abort_info: bool) -> BoxedStrategy<LogicalMessage> {
    let xid = if in_stream {
        any::<u32>().prop_map(Some).boxed()
    } else {
        Just(None).boxed()
    };
    let column = (any::<u8>(), text(), any::<u32>(), any::<i32>()).prop_map(
        |(flags, name, type_oid, type_modifier)| RelationColumn {
            flags,
            name,
            type_oid,
            type_modifier,
        },
    );
    let identity = prop_oneof![
        Just(ReplicaIdentity::Default),
        Just(ReplicaIdentity::Nothing),
        Just(ReplicaIdentity::Full),
        Just(ReplicaIdentity::Index)
    ];
    let data = prop_oneof![
        (
            xid.clone(),
            any::<u32>(),
            text(),
            text(),
            identity,
            proptest::collection::vec(column, 0..10)
        )
            .prop_map(|(xid, oid, namespace, name, replica_identity, columns)| {
                LogicalMessage::Relation(RelationBody {
                    xid,
                    oid,
                    namespace,
                    name,
                    replica_identity,
                    columns,
                })
            }),
        (xid.clone(), any::<u32>(), text(), text()).prop_map(|(xid, oid, namespace, name)| {
            LogicalMessage::Type(TypeBody {
                xid,
                oid,
                namespace,
                name,
            })
        }),
        (xid.clone(), any::<u32>(), tuple_data()).prop_map(|(xid, relation_oid, tuple)| {
            LogicalMessage::Insert(InsertBody {
                xid,
                relation_oid,
                tuple,
            })
        }),
        (
            xid.clone(),
            any::<u32>(),
            proptest::option::of(old_tuple()),
            tuple_data()
        )
            .prop_map(
                |(xid, relation_oid, old, new)| LogicalMessage::Update(UpdateBody {
                    xid,
                    relation_oid,
                    old,
                    new
                })
            ),
        (xid.clone(), any::<u32>(), old_tuple()).prop_map(|(xid, relation_oid, old)| {
            LogicalMessage::Delete(DeleteBody {
                xid,
                relation_oid,
                old,
            })
        }),
        (
            xid.clone(),
            any::<u8>(),
            proptest::collection::vec(any::<u32>(), 0..8)
        )
            .prop_map(|(xid, options, relation_oids)| LogicalMessage::Truncate(
                TruncateBody {
                    xid,
                    options,
                    relation_oids
                }
            )),
        (
            xid,
            any::<u8>(),
            lsn(),
            text(),
            proptest::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(
                |(xid, flags, lsn, prefix, content)| LogicalMessage::Message(MessageBody {
                    xid,
                    flags,
                    lsn,
                    prefix,
                    content: content.into()
                })
            ),
    ];
    let control = prop_oneof![
        (lsn(), ts(), any::<u32>()).prop_map(
            |(final_lsn, commit_time, xid)| LogicalMessage::Begin(BeginBody {
                final_lsn,
                commit_time,
                xid
            })
        ),
        (any::<u8>(), lsn(), lsn(), ts()).prop_map(|(flags, commit_lsn, end_lsn, commit_time)| {
            LogicalMessage::Commit(CommitBody {
                flags,
                commit_lsn,
                end_lsn,
                commit_time,
            })
        }),
        (lsn(), text())
            .prop_map(|(commit_lsn, name)| LogicalMessage::Origin(OriginBody { commit_lsn, name })),
        (any::<u32>(), any::<u8>(), lsn(), lsn(), ts()).prop_map(
            |(xid, flags, commit_lsn, end_lsn, commit_time)| {
                LogicalMessage::StreamCommit(StreamCommitBody {
                    xid,
                    flags,
                    commit_lsn,
                    end_lsn,
                    commit_time,
                })
            }
        ),
        (any::<u32>(), any::<u32>(), lsn(), ts()).prop_map(move |(xid, subxid, l, t)| {
            LogicalMessage::StreamAbort(StreamAbortBody {
                xid,
                subxid,
                abort: abort_info.then_some((l, t)),
            })
        }),
        (lsn(), lsn(), ts(), any::<u32>(), text()).prop_map(
            |(prepare_lsn, end_lsn, prepare_time, xid, gid)| {
                LogicalMessage::BeginPrepare(BeginPrepareBody {
                    prepare_lsn,
                    end_lsn,
                    prepare_time,
                    xid,
                    gid,
                })
            }
        ),
        (
            any::<bool>(),
            any::<u8>(),
            lsn(),
            lsn(),
            ts(),
            any::<u32>(),
            text()
        )
            .prop_map(
                |(streamed, flags, prepare_lsn, end_lsn, prepare_time, xid, gid)| {
                    let body = PrepareBody {
                        flags,
                        prepare_lsn,
                        end_lsn,
                        prepare_time,
                        xid,
                        gid,
                    };
                    if streamed {
                        LogicalMessage::StreamPrepare(body)
                    } else {
                        LogicalMessage::Prepare(body)
                    }
                }
            ),
        (any::<u8>(), lsn(), lsn(), ts(), any::<u32>(), text()).prop_map(
            |(flags, commit_lsn, end_lsn, commit_time, xid, gid)| {
                LogicalMessage::CommitPrepared(CommitPreparedBody {
                    flags,
                    commit_lsn,
                    end_lsn,
                    commit_time,
                    xid,
                    gid,
                })
            }
        ),
        (any::<u8>(), lsn(), lsn(), ts(), ts(), any::<u32>(), text()).prop_map(
            |(flags, prepare_end_lsn, rollback_end_lsn, prepare_time, rollback_time, xid, gid)| {
                LogicalMessage::RollbackPrepared(RollbackPreparedBody {
                    flags,
                    prepare_end_lsn,
                    rollback_end_lsn,
                    prepare_time,
                    rollback_time,
                    xid,
                    gid,
                })
            }
        ),
    ];
    if in_stream {
        data.boxed()
    } else {
        prop_oneof![data, control].boxed()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn messages_round_trip(m in message(false, false)) {
        let bytes = encode(&m);
        prop_assert_eq!(v(4).decode(bytes.clone()).unwrap(), m);
        // Every strict prefix is an error, never a panic, never a success.
        for cut in 0..bytes.len() {
            prop_assert!(v(4).decode(bytes.slice(..cut)).is_err());
        }
    }

    #[test]
    fn streamed_messages_round_trip(m in message(true, false), xid in any::<u32>()) {
        prop_assert_eq!(streaming(2, xid).decode(encode(&m)).unwrap(), m);
    }

    #[test]
    fn v4_parallel_stream_aborts_round_trip(m in message(false, true)) {
        let mut d = v(4).with_parallel_streaming(true);
        prop_assert_eq!(d.decode(encode(&m)).unwrap(), m);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256), version in 1u32..=4, stream in any::<bool>()) {
        let mut d = v(version).with_parallel_streaming(stream);
        if stream && version >= 2 {
            d = streaming(version, 1);
        }
        let _ = d.decode(Bytes::from(bytes.clone()));
        let _ = crate::ReplicationMessage::parse(Bytes::from(bytes));
    }

    #[test]
    fn lsn_text_round_trips(raw in any::<u64>()) {
        prop_assert_eq!(Lsn::new(raw).to_string().parse::<Lsn>().unwrap(), Lsn::new(raw));
    }
}

#[test]
fn a_tuple_from_text_is_laid_out_like_a_streamed_one() {
    let values: [Option<&[u8]>; 3] = [Some(b"7"), None, Some(b"{\"a\": 1}")];
    let built = crate::TupleData::from_text(values).unwrap();
    let streamed = tuple(&[
        Value::Text(b"7".to_vec()),
        Value::Null,
        Value::Text(b"{\"a\": 1}".to_vec()),
    ]);
    assert_eq!(built, streamed);
    assert_eq!(built.get(2).and_then(|c| c.as_str()), Some("{\"a\": 1}"));
    assert!(built.get(1).is_some_and(|c| c.as_str().is_none()));
}

#[test]
fn a_relation_from_the_catalog_finds_columns_by_name() {
    let r = RelationBody::from_catalog(
        0,
        "public",
        "outbox",
        [("id".to_owned(), 2950), ("payload".to_owned(), 3802)],
    );
    assert_eq!(r.column_index("payload"), Some(1));
    assert_eq!(r.columns()[0].type_oid(), 2950);
    assert_eq!((r.namespace(), r.name()), ("public", "outbox"));
}
