//! Relation messages, synchronously: a table renamed or altered under the
//! stream maps by its new layout; a tuple that does not fit its relation
//! stops the relay; a relation that cannot be mapped follows the
//! dead-letter policy.

use super::{acked, config, confirmable, feed, records, report, sends, started};
use crate::dead_letter::{headers, DeadLetters};
use crate::relay::tests::fakes::{
    begin, commit, header, insert_row, relation, relation_of, COLUMNS, OUTBOX, TEXT, UUID,
};
use crate::relay::RunError;

#[test]
fn a_renamed_table_with_a_dropped_column_maps_by_its_new_layout() {
    let config = config(DeadLetters::halt(), None);
    let mut core = started(&config, 10);
    // The table had a column `note` before the payload.
    let mut with_note = COLUMNS.to_vec();
    with_note.insert(4, ("note", TEXT));
    feed(
        &mut core,
        vec![
            relation_of(OUTBOX, "outbox_events", &with_note),
            // ALTER TABLE … RENAME TO outbox_old; ALTER TABLE … DROP note:
            // the same OID under another name, the payload one place earlier.
            begin(190),
            relation_of(OUTBOX, "outbox_old", &COLUMNS),
            insert_row(
                150,
                OUTBOX,
                &[
                    Some("e1"),
                    Some("order"),
                    Some("a"),
                    Some("Created"),
                    Some(r#"{"n":1}"#),
                ],
            ),
            commit(190, 200),
        ],
    );
    let record = sends(&mut core).remove(0).record;
    assert_eq!(
        record.value.as_deref(),
        Some(&br#"{"n":1}"#[..]),
        "the payload column, not whatever sits where it used to"
    );
    assert_eq!(header(&record, "event_type"), Some("Created"));
    report(&mut core, acked(record.token)).unwrap();
    assert_eq!(confirmable(&mut core), 200);
}

#[test]
fn a_tuple_wider_or_narrower_than_its_relation_stops_the_relay() {
    let config = config(DeadLetters::to_topic("dlq"), None);
    let mut core = started(&config, 10);
    feed(&mut core, vec![relation(), begin(190)]);
    let narrow = insert_row(
        150,
        OUTBOX,
        &[Some("e1"), Some("order"), Some("a"), Some("{}")],
    );
    let e = core.message(narrow).unwrap_err();
    assert!(matches!(e, RunError::ColumnCount(_)), "{e}");
    assert!(e.to_string().contains("has 4 columns"), "{e}");
    assert_eq!(COLUMNS.len(), 5);
    assert_eq!(confirmable(&mut core), 10);
}

#[test]
fn a_relation_that_cannot_be_mapped_follows_the_dead_letter_policy() {
    let config = config(DeadLetters::to_topic("dlq"), None);
    let mut core = started(&config, 10);
    // The payload column was dropped.
    let no_payload = [
        ("id", UUID),
        ("aggregate_type", TEXT),
        ("aggregate_id", TEXT),
        ("event_type", TEXT),
    ];
    feed(
        &mut core,
        vec![
            relation_of(OUTBOX, "outbox_events", &no_payload),
            begin(190),
            insert_row(
                150,
                OUTBOX,
                &[Some("e1"), Some("order"), Some("a"), Some("Created")],
            ),
            commit(190, 200),
        ],
    );
    let records: Vec<_> = records(&mut core);
    assert_eq!(records.len(), 1);
    let dead = &records[0];
    assert_eq!(&*dead.topic, "dlq");
    assert_eq!(header(dead, headers::ERROR_KIND), Some("unmappable"));
    assert!(header(dead, headers::ERROR)
        .unwrap()
        .contains("no column \"payload\""));
    report(&mut core, acked(dead.token.clone())).unwrap();
    assert_eq!(confirmable(&mut core), 200);
}
