//! Fixtures captured from real servers (PostgreSQL 15 and 18) by
//! `scripts/capture-fixtures`: every message decodes, and the decoded values
//! are what the capture script wrote.

use std::collections::HashMap;
use std::path::PathBuf;

use bytes::Bytes;
use pgoutput_decoder::{Column, Decoder, LogicalMessage, Lsn, OldTuple, RelationCache};

const VERSIONS: [&str; 2] = ["pg15", "pg18"];

/// One captured message: (LSN, xid, bytes).
type Captured = (Lsn, u32, Bytes);

fn load(version: &str, file: &str) -> Vec<Captured> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(version)
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|line| {
            let mut f = line.split('\t');
            let lsn = f.next().unwrap().parse().unwrap();
            let xid = f.next().unwrap().parse().unwrap();
            let hex = f.next().unwrap();
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            (lsn, xid, Bytes::from(bytes))
        })
        .collect()
}

fn decode_all(decoder: &mut Decoder, captured: &[Captured]) -> Vec<LogicalMessage> {
    captured
        .iter()
        .enumerate()
        .map(|(i, (lsn, _, bytes))| {
            decoder
                .decode(bytes.clone())
                .unwrap_or_else(|e| panic!("message {i} at {lsn}: {e}"))
        })
        .collect()
}

fn tags(messages: &[LogicalMessage]) -> String {
    messages.iter().map(|m| m.tag() as char).collect()
}

/// Checks Begin/Commit pairing the way walbox will: no nested Begin, and
/// Commit's commit_lsn equals Begin's final_lsn.
fn assert_transactions_pair(messages: &[LogicalMessage]) -> usize {
    let mut open = None;
    let mut count = 0;
    for m in messages {
        match m {
            LogicalMessage::Begin(b) => {
                assert!(open.is_none(), "nested Begin");
                open = Some(b.final_lsn());
            }
            LogicalMessage::Commit(c) => {
                assert_eq!(Some(c.commit_lsn()), open.take(), "Commit matches Begin");
                assert!(c.end_lsn() > c.commit_lsn());
                count += 1;
            }
            _ => {}
        }
    }
    assert!(open.is_none());
    count
}

#[test]
fn dml_fixture_decodes_inserts_updates_deletes_and_truncate() {
    for version in VERSIONS {
        let captured = load(version, "dml_v1.tsv");
        let messages = decode_all(&mut Decoder::new(1).unwrap(), &captured);
        assert_eq!(tags(&messages), "BRIIRIICBUCBUCBDCBDCBRTC", "{version}");
        assert_eq!(assert_transactions_pair(&messages), 6);

        // Begin's xid is the transaction id the server reported.
        let LogicalMessage::Begin(begin) = &messages[0] else {
            panic!()
        };
        assert_eq!(begin.xid(), captured[0].1);

        let mut cache = RelationCache::new();
        let mut outbox_rows = Vec::new();
        let mut account_rows = Vec::new();
        let mut oids = HashMap::new();
        for m in &messages {
            match m {
                LogicalMessage::Relation(r) => {
                    oids.insert(r.name().to_owned(), r.oid());
                    cache.insert(r.clone());
                }
                LogicalMessage::Insert(i) => {
                    let row = cache.resolve(i.relation_oid(), i.tuple()).unwrap();
                    let values: HashMap<&str, Option<&str>> =
                        row.iter().map(|(n, c)| (n, c.as_str())).collect();
                    match row.relation().name() {
                        "outbox_events" => outbox_rows.push(format!(
                            "{}|{}|{}|{}|{}",
                            values["id"].unwrap(),
                            values["aggregate_id"].unwrap(),
                            values["event_type"].unwrap(),
                            values["payload"].unwrap(),
                            values["headers"].unwrap()
                        )),
                        "accounts" => account_rows.push(format!(
                            "{}|{}|{}|{:?}",
                            values["id"].unwrap(),
                            values["owner"].unwrap(),
                            values["balance"].unwrap(),
                            values["note"]
                        )),
                        other => panic!("unexpected table {other}"),
                    }
                }
                _ => {}
            }
        }
        assert_eq!(
            outbox_rows,
            [
                r#"6d1f1c9e-0000-4000-8000-000000000001|order-17|OrderCreated|{"total": 42}|{"trace": "t-1"}"#,
                "6d1f1c9e-0000-4000-8000-000000000002|order-17|OrderPaid|{}|{}",
            ]
        );
        assert_eq!(account_rows, ["1|ada|100.50|None", "2|bob|7|Some(\"vip\")"]);

        // Replica identity full: updates and deletes carry the whole old row.
        let LogicalMessage::Update(u) = &messages[9] else {
            panic!()
        };
        let Some(OldTuple::Full(old)) = u.old() else {
            panic!("full old row")
        };
        assert_eq!(old.get(2).unwrap().as_str(), Some("100.50"));
        assert_eq!(u.new_tuple().get(2).unwrap().as_str(), Some("90.50"));
        let LogicalMessage::Update(u) = &messages[12] else {
            panic!()
        };
        assert_eq!(u.old().unwrap().tuple().get(0).unwrap().as_str(), Some("2"));
        assert_eq!(u.new_tuple().get(0).unwrap().as_str(), Some("3"));
        let LogicalMessage::Delete(d) = &messages[15] else {
            panic!()
        };
        assert!(matches!(d.old(), OldTuple::Full(_)));
        // Default identity: the outbox delete carries only the key.
        let LogicalMessage::Delete(d) = &messages[18] else {
            panic!()
        };
        let OldTuple::Key(key) = d.old() else {
            panic!("key only")
        };
        assert_eq!(
            key.get(0).unwrap().as_str(),
            Some("6d1f1c9e-0000-4000-8000-000000000002")
        );
        assert_eq!(key.get(3), Some(Column::Null));

        let LogicalMessage::Truncate(t) = &messages[22] else {
            panic!()
        };
        assert!(t.cascade() && t.restart_identity());
        assert_eq!(t.relation_oids(), &[oids["accounts"]]);
    }
}

#[test]
fn message_fixture_decodes_transactional_and_binary_messages() {
    for version in VERSIONS {
        let messages = decode_all(
            &mut Decoder::new(1).unwrap(),
            &load(version, "message_v1.tsv"),
        );
        assert_eq!(tags(&messages), "BMRICM", "{version}");
        let LogicalMessage::Message(m) = &messages[1] else {
            panic!()
        };
        assert!(m.transactional());
        assert_eq!(
            (m.prefix(), &m.content()[..]),
            ("walbox", &b"in-transaction"[..])
        );
        let LogicalMessage::Message(m) = &messages[5] else {
            panic!()
        };
        assert!(!m.transactional());
        assert_eq!(
            (m.prefix(), &m.content()[..]),
            ("walbox.bin", &[0xff, 0x00, 0xfe][..])
        );
        assert!(m.lsn() > Lsn::ZERO);
    }
}

#[test]
fn toast_fixture_marks_the_unchanged_toasted_column() {
    for version in VERSIONS {
        let messages = decode_all(
            &mut Decoder::new(1).unwrap(),
            &load(version, "toast_v1.tsv"),
        );
        assert_eq!(tags(&messages), "BRICBUC", "{version}");
        let LogicalMessage::Insert(i) = &messages[2] else {
            panic!()
        };
        assert_eq!(
            i.tuple().get(2).unwrap().as_str().unwrap().len(),
            "walbox ".len() * 1200
        );
        let LogicalMessage::Update(u) = &messages[5] else {
            panic!()
        };
        let cols: Vec<Column<'_>> = u.new_tuple().iter().collect();
        assert_eq!(
            cols,
            [
                Column::Text(b"1"),
                Column::Text(b"final"),
                Column::UnchangedToast
            ]
        );
    }
}

/// A Stream Abort's (xid, subxid, abort LSN).
type StreamAbort = (u32, u32, Option<Lsn>);

/// Walks a streamed capture the way a consumer of streamed transactions must:
/// data messages inside a block carry the xid of the (sub)transaction that made
/// the change; Stream Commit names the top-level xid; Stream Abort names the
/// top-level xid and the aborted subtransaction's. Returns inserts per
/// aggregate id of committed transactions and the Stream Abort messages.
fn walk_stream(messages: &[LogicalMessage]) -> (HashMap<String, usize>, Vec<StreamAbort>) {
    let mut cache = RelationCache::new();
    let mut block_xid = None;
    // change xid -> (top-level xid, aggregate ids inserted)
    let mut pending: HashMap<u32, (u32, Vec<String>)> = HashMap::new();
    let mut committed: HashMap<String, usize> = HashMap::new();
    let mut aborts = Vec::new();
    for m in messages {
        match m {
            LogicalMessage::StreamStart(s) => {
                assert!(block_xid.is_none());
                block_xid = Some(s.xid());
            }
            LogicalMessage::StreamStop => assert!(block_xid.take().is_some()),
            LogicalMessage::Relation(r) => {
                assert!(r.xid().is_some() && block_xid.is_some());
                cache.insert(r.clone());
            }
            LogicalMessage::Insert(i) => {
                let top = block_xid.expect("insert inside a block");
                let xid = i.xid().expect("inside a block, inserts carry an xid");
                let row = cache.resolve(i.relation_oid(), i.tuple()).unwrap();
                let entry = pending.entry(xid).or_insert((top, Vec::new()));
                assert_eq!(
                    entry.0, top,
                    "a subtransaction belongs to one top-level transaction"
                );
                entry.1.push(row.text("aggregate_id").unwrap().to_owned());
            }
            LogicalMessage::StreamCommit(c) => {
                assert!(block_xid.is_none());
                assert!(c.end_lsn() > c.commit_lsn());
                let xids: Vec<u32> = pending
                    .iter()
                    .filter(|(_, (top, _))| *top == c.xid())
                    .map(|(x, _)| *x)
                    .collect();
                assert!(!xids.is_empty(), "streamed before commit");
                for xid in xids {
                    for agg in pending.remove(&xid).unwrap().1 {
                        *committed.entry(agg).or_default() += 1;
                    }
                }
            }
            LogicalMessage::StreamAbort(a) => {
                aborts.push((a.xid(), a.subxid(), a.abort_lsn()));
                if a.xid() == a.subxid() {
                    pending.retain(|_, (top, _)| *top != a.xid());
                } else {
                    assert!(
                        pending.remove(&a.subxid()).is_some(),
                        "the aborted subtransaction streamed rows"
                    );
                }
            }
            other => panic!("unexpected {:?} in a streamed capture", other.tag() as char),
        }
    }
    assert!(block_xid.is_none());
    (committed, aborts)
}

#[test]
fn streamed_fixtures_decode_blocks_commits_and_aborts() {
    for (version, file, proto, parallel) in [
        ("pg15", "stream_v2.tsv", 2, false),
        ("pg18", "stream_v2.tsv", 2, false),
        ("pg18", "stream_v4.tsv", 4, true),
    ] {
        let captured = load(version, file);
        let mut decoder = Decoder::new(proto)
            .unwrap()
            .with_parallel_streaming(parallel);
        let messages = decode_all(&mut decoder, &captured);
        let (committed, aborts) = walk_stream(&messages);
        let bulk: usize = (0..10)
            .map(|g| committed.get(&format!("order-{g}")).copied().unwrap_or(0))
            .sum();
        assert_eq!(
            bulk, 600,
            "{version} {file}: the committed bulk transaction"
        );
        assert_eq!(committed.get("kept"), Some(&401), "{version} {file}");
        assert_eq!(committed.get("sub-aborted"), None, "{version} {file}");
        assert_eq!(committed.get("aborted"), None, "{version} {file}");
        let sub_aborts: Vec<_> = aborts.iter().filter(|(x, s, _)| x != s).collect();
        assert_eq!(sub_aborts.len(), 1, "{version} {file}: {aborts:?}");
        for (_, _, abort_lsn) in &aborts {
            // v4 with parallel streaming sends the abort LSN; v2 does not.
            assert_eq!(abort_lsn.is_some(), parallel, "{version} {file}");
        }
        // A v1 decoder cannot read streamed messages.
        let e = Decoder::new(1)
            .unwrap()
            .decode(captured[0].2.clone())
            .unwrap_err();
        assert!(e.to_string().contains("needs 2"), "{e}");
    }
}

#[test]
fn two_phase_fixture_decodes_prepare_commit_and_rollback() {
    for version in VERSIONS {
        let captured = load(version, "two_phase_v3.tsv");
        let messages = decode_all(&mut Decoder::new(3).unwrap(), &captured);
        let t = tags(&messages);
        assert!(t.starts_with("bRIPKbIPrSRI"), "{version}: {t}");
        assert!(t.ends_with("EpK"), "{version}: {t}");

        let LogicalMessage::BeginPrepare(b) = &messages[0] else {
            panic!()
        };
        let LogicalMessage::Prepare(p) = &messages[3] else {
            panic!()
        };
        let LogicalMessage::CommitPrepared(k) = &messages[4] else {
            panic!()
        };
        assert_eq!(
            (b.gid(), p.gid(), k.gid()),
            ("walbox-gid-1", "walbox-gid-1", "walbox-gid-1")
        );
        assert_eq!(b.prepare_lsn(), p.prepare_lsn());
        assert_eq!(b.xid(), k.xid());
        assert!(k.commit_lsn() > p.prepare_lsn());

        let LogicalMessage::RollbackPrepared(r) = &messages[8] else {
            panic!()
        };
        assert_eq!(r.gid(), "walbox-gid-2");
        assert!(r.rollback_end_lsn() > r.prepare_end_lsn());

        let n = messages.len();
        let LogicalMessage::StreamPrepare(sp) = &messages[n - 2] else {
            panic!()
        };
        let LogicalMessage::CommitPrepared(k) = &messages[n - 1] else {
            panic!()
        };
        assert_eq!((sp.gid(), k.gid()), ("walbox-gid-3", "walbox-gid-3"));
        let streamed_inserts = messages
            .iter()
            .filter(|m| matches!(m, LogicalMessage::Insert(i) if i.xid() == Some(sp.xid())))
            .count();
        assert_eq!(streamed_inserts, 600);

        // Two-phase messages do not exist before protocol 3.
        let e = Decoder::new(2)
            .unwrap()
            .decode(captured[0].2.clone())
            .unwrap_err();
        assert!(e.to_string().contains("needs 3"), "{e}");
    }
}
