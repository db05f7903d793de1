//! The consumer-side checker: reads what reached the topics and compares it
//! with what was written.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use pgoutput_decoder::Lsn;
use rdkafka::message::{Message, OwnedMessage};
use walbox_test_harness::kafka::{consume_until_quiet, TestKafka};

/// What one scenario did, as the consumer sees it.
#[derive(Debug, Default, Clone)]
pub(crate) struct Tally {
    /// Events committed to the outbox.
    pub(crate) written: usize,
    /// Distinct events that reached their topic.
    pub(crate) delivered: usize,
    /// Distinct events that reached the dead-letter topic instead.
    pub(crate) dead_lettered: usize,
    /// Written, reached neither topic.
    pub(crate) missing: usize,
    /// Copies beyond the first (both topics).
    pub(crate) duplicates: usize,
    /// Per key, first arrivals out of commit order.
    pub(crate) order_violations: usize,
    /// Missing events that the slot was seen confirmed past.
    pub(crate) confirmed_past: usize,
    /// Records whose value is not the event's payload.
    pub(crate) wrong_payloads: usize,
}

/// `n` and key of a record written by the load, if it is one.
fn event_of(m: &OwnedMessage) -> Option<(i64, Vec<u8>)> {
    let v: serde_json::Value = serde_json::from_slice(m.payload()?).ok()?;
    Some((v["n"].as_i64()?, m.key().unwrap_or_default().to_vec()))
}

async fn read_all(kafka: &TestKafka, topic: &str) -> Vec<OwnedMessage> {
    consume_until_quiet(
        kafka,
        topic,
        Duration::from_secs(3),
        Duration::from_secs(120),
    )
    .await
    .unwrap_or_else(|e| panic!("read {topic}: {e}"))
}

/// Reads both topics and tallies them against `written` (`n` → the WAL
/// position after its commit, `Lsn::MAX` when unknown).
pub(crate) async fn tally(
    kafka: &TestKafka,
    topic: &str,
    dead_letters: &str,
    written: &BTreeMap<i64, Lsn>,
    max_confirmed: Lsn,
) -> Tally {
    let mut main = read_all(kafka, topic).await;
    let dlq = read_all(kafka, dead_letters).await;
    let mut t = Tally {
        written: written.len(),
        ..Tally::default()
    };
    main.sort_by_key(|m| (m.partition(), m.offset()));
    let mut seen = HashSet::new();
    let mut last_per_key: HashMap<Vec<u8>, i64> = HashMap::new();
    for m in &main {
        let Some((n, key)) = event_of(m) else {
            t.wrong_payloads += 1;
            continue;
        };
        // The load's keys are agg-<n mod KEYS>; a scenario's own events use
        // another prefix, so each group's commit order is its n order.
        if !key.ends_with(format!("-{}", n % crate::world::KEYS).as_bytes()) {
            t.wrong_payloads += 1;
        }
        if !seen.insert(n) {
            t.duplicates += 1;
            continue;
        }
        if let Some(prev) = last_per_key.insert(key, n) {
            if prev > n {
                t.order_violations += 1;
            }
        }
    }
    t.delivered = seen.len();
    let mut dead = HashSet::new();
    for m in &dlq {
        // A dead-letter copy carries the original payload.
        if let Some((n, _)) = event_of(m) {
            if !dead.insert(n) || seen.contains(&n) {
                t.duplicates += 1;
            }
        }
    }
    t.dead_lettered = dead.len();
    for (n, upper) in written {
        if !seen.contains(n) && !dead.contains(n) {
            t.missing += 1;
            if *upper <= max_confirmed {
                t.confirmed_past += 1;
            }
        }
    }
    t
}
