//! Several outbox tables (`table = tenant_*.outbox_events`): rows of every
//! matching table are events, topics may name their table, and a coverage
//! reading stops the relay for a change of any table's coverage or a table
//! someone else added, not for one walbox picked up or one dropped.

use bytes::Bytes;
use pgoutput_decoder::test_util as frames;
use pgoutput_decoder::{Lsn, ReplicationMessage};
use slot_manager::{Coverage, OutboxTables, TableCoverage, TableName};

use super::Harness;
use super::{acked, config, covered, feed, report, sends, start, started};
use crate::dead_letter::DeadLetters;
use crate::mapping::{OutboxMapping, TableMapping};
use crate::relay::tests::fakes::{begin, commit, insert_row, COLUMNS, JSONB, TEXT, UUID};
use crate::relay::{RelayConfig, RunError};

fn xlog(lsn: u64, data: Bytes) -> ReplicationMessage {
    frames::xlog(Lsn::from(lsn), Lsn::from(lsn), data)
}

fn tenants(template: &str) -> RelayConfig {
    let mut config = config(DeadLetters::halt(), None);
    config.tables = OutboxTables::parse("tenant_*.outbox_events").unwrap();
    config.mapping.topic_template = template.into();
    config
}

fn row(lsn: u64, oid: u32, id: &str, aggregate: &str) -> ReplicationMessage {
    insert_row(
        lsn,
        oid,
        &[
            Some(id),
            Some("order"),
            Some(aggregate),
            Some("Created"),
            Some("{}"),
        ],
    )
}

#[test]
fn rows_of_every_matching_table_are_events_on_their_tables_topics() {
    let config = tenants("{schema}.{aggregate_type}");
    let mut core = started(&config, 10);
    feed(
        &mut core,
        vec![
            xlog(
                0,
                frames::relation(1, "tenant_a", "outbox_events", &COLUMNS),
            ),
            xlog(
                0,
                frames::relation(2, "tenant_b", "outbox_events", &COLUMNS),
            ),
            xlog(0, frames::relation(3, "billing", "outbox_events", &COLUMNS)),
            begin(190),
            row(150, 1, "e1", "k"),
            row(160, 3, "e2", "k"),
            row(170, 2, "e3", "k"),
            commit(190, 200),
        ],
    );
    let sent: Vec<_> = sends(&mut core).into_iter().map(|s| s.record).collect();
    let topics: Vec<&str> = sent.iter().map(|r| &*r.topic).collect();
    assert_eq!(
        topics,
        ["tenant_a.order", "tenant_b.order"],
        "billing.outbox_events matches no entry"
    );
    for record in sent {
        report(&mut core, acked(record.token)).unwrap();
    }
}

/// Debezium's column names, in another order than walbox's.
const DEBEZIUM_COLUMNS: [(&str, u32); 5] = [
    ("payload", JSONB),
    ("type", TEXT),
    ("aggregateid", TEXT),
    ("aggregatetype", TEXT),
    ("id", UUID),
];

/// The tenants, and `legacy.outbox` laid out as Debezium's EventRouter
/// table with a topic template of its own.
fn tenants_and_legacy() -> RelayConfig {
    let mut config = tenants("outbox.event.{aggregate_type}");
    config.tables = OutboxTables::parse("tenant_*.outbox_events, legacy.outbox").unwrap();
    config.mapping.tables = vec![TableMapping {
        key: "legacy.outbox".into(),
        tables: OutboxTables::parse("legacy.outbox").unwrap(),
        mapping: OutboxMapping {
            topic_template: "legacy.{aggregate_type}".into(),
            ..OutboxMapping::debezium()
        },
    }];
    config
}

#[test]
fn a_table_with_a_mapping_of_its_own_maps_its_rows_by_it() {
    let config = tenants_and_legacy();
    let mut core = started(&config, 10);
    feed(
        &mut core,
        vec![
            xlog(
                0,
                frames::relation(1, "tenant_a", "outbox_events", &COLUMNS),
            ),
            xlog(
                0,
                frames::relation(2, "legacy", "outbox", &DEBEZIUM_COLUMNS),
            ),
            begin(190),
            row(150, 1, "e1", "k1"),
            insert_row(
                160,
                2,
                &[
                    Some("{\"n\":2}"),
                    Some("Shipped"),
                    Some("k2"),
                    Some("order"),
                    Some("e2"),
                ],
            ),
            row(170, 1, "e3", "k3"),
            commit(190, 200),
        ],
    );
    let sent: Vec<_> = sends(&mut core).into_iter().map(|s| s.record).collect();
    let seen: Vec<_> = sent
        .iter()
        .map(|r| {
            let headers: Vec<(&str, &[u8])> =
                r.headers.iter().map(|h| (&*h.name, &h.value[..])).collect();
            (&*r.topic, &r.key.as_ref().unwrap()[..], headers)
        })
        .collect();
    assert_eq!(
        seen,
        [
            (
                "outbox.event.order",
                &b"k1"[..],
                vec![("id", &b"e1"[..]), ("event_type", &b"Created"[..])]
            ),
            (
                "legacy.order",
                &b"k2"[..],
                vec![("id", &b"e2"[..]), ("event_type", &b"Shipped"[..])]
            ),
            (
                "outbox.event.order",
                &b"k3"[..],
                vec![("id", &b"e3"[..]), ("event_type", &b"Created"[..])]
            ),
        ],
        "each table's columns, and its topic (one aggregate type, two templates)"
    );
    assert_eq!(sent[1].value.as_deref(), Some(&b"{\"n\":2}"[..]));
    for record in sent {
        report(&mut core, acked(record.token)).unwrap();
    }
}

#[test]
fn a_row_of_a_table_its_mapping_does_not_fit_is_unmappable() {
    let config = tenants_and_legacy();
    let mut core = started(&config, 10);
    // legacy.outbox laid out as the tenants' tables: its own mapping's
    // columns (aggregatetype, …) are missing.
    let stopped = stops(
        &mut core,
        vec![
            xlog(0, frames::relation(2, "legacy", "outbox", &COLUMNS)),
            begin(190),
            row(150, 2, "e1", "k1"),
            commit(190, 200),
        ],
    )
    .to_string();
    assert!(
        stopped.contains(
            "table legacy.outbox has no column \"aggregatetype\" (mapped as the aggregate type)"
        ),
        "{stopped}"
    );
    assert!(sends(&mut core).is_empty());
}

#[test]
fn a_payload_of_a_type_the_session_has_not_resolved_starts_a_new_session() {
    let config = tenants("events");
    // A domain made after the session started (its OID is a user's), on a
    // table picked up since: the next session reads the catalog again.
    let mut core = started(&config, 10);
    let stopped = stops(
        &mut core,
        vec![
            xlog(
                0,
                frames::relation(4, "tenant_g", "outbox_events", &with_payload(70_000)),
            ),
            begin(190),
            row(150, 4, "e1", "k1"),
        ],
    );
    assert!(
        matches!(
            stopped,
            RunError::UnresolvedType {
                type_oid: 70_000,
                ..
            }
        ) && stopped.is_transient(),
        "{stopped}"
    );
    assert!(sends(&mut core).is_empty());
    // A built-in type that is no payload type stays a row walbox cannot map.
    let mut core = started(&config, 10);
    let stopped = stops(
        &mut core,
        vec![
            xlog(
                0,
                frames::relation(5, "tenant_h", "outbox_events", &with_payload(23)),
            ),
            begin(190),
            row(150, 5, "e1", "k1"),
        ],
    );
    assert!(
        matches!(stopped, RunError::Map(_)) && !stopped.is_transient(),
        "{stopped}"
    );
}

/// The error the core stops with on `frames`.
fn stops(core: &mut Harness<'_>, frames: Vec<ReplicationMessage>) -> RunError {
    frames
        .into_iter()
        .find_map(|frame| core.message(frame).err())
        .expect("the relay stops")
}

/// walbox's columns, the payload of type `payload`.
fn with_payload(payload: u32) -> [(&'static str, u32); 5] {
    let mut columns = COLUMNS;
    columns[4].1 = payload;
    columns
}

fn table(schema: &str, oid: u32, fingerprint: &str) -> TableCoverage {
    TableCoverage {
        table: TableName::new(schema, "outbox_events"),
        oid: Some(oid),
        fingerprint: fingerprint.into(),
    }
}

fn reading(wal: u64, tables: Vec<TableCoverage>, added: &[&str]) -> Coverage {
    Coverage {
        table_oid: None,
        fingerprint: tables
            .iter()
            .map(|t| format!("{}: {}", t.table, t.fingerprint))
            .collect::<Vec<_>>()
            .join("; "),
        tables,
        added: added
            .iter()
            .map(|s| TableName::new(*s, "outbox_events"))
            .collect(),
        ..covered(wal)
    }
}

/// A core whose session has read no coverage yet.
fn session(config: &RelayConfig) -> Harness<'_> {
    let mut core = Harness::new(config);
    start(&mut core, 10);
    core
}

#[test]
fn a_table_walbox_picked_up_or_one_dropped_is_no_drift() {
    let config = tenants("events");
    let mut core = session(&config);
    let a = table("tenant_a", 1, "fa");
    let b = table("tenant_b", 2, "fb");
    let c = table("tenant_c", 3, "fc");
    core.coverage(reading(100, vec![a.clone(), b.clone()], &[]))
        .unwrap();
    core.coverage(reading(
        200,
        vec![a.clone(), b.clone(), c.clone()],
        &["tenant_c"],
    ))
    .unwrap();
    // tenant_b dropped (the source reports a table that left the
    // publication while it exists as a gap, not by leaving it out).
    core.coverage(reading(300, vec![a, c], &[])).unwrap();
}

#[test]
fn a_change_of_one_tables_coverage_or_a_table_someone_else_added_stops() {
    let config = tenants("events");
    let a = table("tenant_a", 1, "fa");
    let b = table("tenant_b", 2, "fb");
    for (now, says) in [
        (
            vec![a.clone(), table("tenant_b", 2, "fb-altered")],
            "the publication's coverage of outbox table \"tenant_b\".\"outbox_events\" changed",
        ),
        (
            vec![a.clone(), table("tenant_b", 9, "fb-recreated")],
            "outbox table \"tenant_b\".\"outbox_events\" was dropped and recreated (OID 2 → 9)",
        ),
        (
            vec![a.clone(), b.clone(), table("tenant_d", 4, "fd")],
            "outbox table \"tenant_d\".\"outbox_events\" joined the publication, added by someone else",
        ),
    ] {
        let mut core = session(&config);
        core.coverage(reading(100, vec![a.clone(), b.clone()], &[]))
            .unwrap();
        let stopped = core.coverage(reading(200, now, &[])).unwrap_err();
        let RunError::Drift(drift) = &stopped else {
            panic!("{stopped}")
        };
        let text = drift.to_string();
        assert!(text.contains(says), "{text}");
        assert!(
            text.contains("re-insert them") && !text.contains("walbox resync"),
            "several tables' remedy: {text}"
        );
    }
}
