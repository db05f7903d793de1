//! The consumer-side checker: reads what reached the topics and compares it
//! with what was written.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use pgoutput_decoder::Lsn;
use rdkafka::message::{Message, OwnedMessage};
use walbox_test_harness::kafka::{consume_to_end, TestKafka};

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
    /// Events on the wrong topic: dead-lettered while they should have been
    /// delivered, or the other way round (checked where a scenario knows).
    pub(crate) misrouted: usize,
}

/// What a scenario knows about where each event belongs.
pub(crate) struct Expect<'a> {
    /// The highest position the slot that streams event `n` was seen
    /// confirmed at.
    pub(crate) confirmed: &'a dyn Fn(i64) -> Lsn,
    /// Whether event `n` belongs on the dead-letter topic (`None`: the
    /// scenario does not say).
    pub(crate) dead_letter: Option<&'a dyn Fn(i64) -> bool>,
}

/// `n` and key of a record written by the load, if it is one.
fn event_of(m: &OwnedMessage) -> Option<(i64, Vec<u8>)> {
    let v: serde_json::Value = serde_json::from_slice(m.payload()?).ok()?;
    Some((v["n"].as_i64()?, m.key().unwrap_or_default().to_vec()))
}

/// How many records `topic` holds: the sum of its partitions' watermark
/// spans. A broker that already dropped records (retention: the mock
/// cluster keeps about 100,000 records or 5 MB per partition) makes the
/// check blind, which is an error, not a loss.
async fn records_in(kafka: &TestKafka, topic: &str) -> Result<i64, String> {
    let config = kafka.client_config();
    let name = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let c: BaseConsumer = config.create().map_err(|e| e.to_string())?;
        let timeout = Duration::from_secs(10);
        let md = c
            .fetch_metadata(Some(&name), timeout)
            .map_err(|e| e.to_string())?;
        let partitions = md
            .topics()
            .first()
            .map(|t| t.partitions().len())
            .unwrap_or(0);
        let mut total = 0;
        for p in 0..partitions as i32 {
            let (low, high) = c
                .fetch_watermarks(&name, p, timeout)
                .map_err(|e| e.to_string())?;
            if low > 0 {
                return Err(format!(
                    "partition {p} starts at offset {low}: the broker dropped records (retention), the check cannot see them all"
                ));
            }
            total += high - low;
        }
        Ok(total)
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Every record of `topic` a `read_committed` consumer sees: read until
/// its position reaches each partition's high watermark (exact on
/// transactional topics too, whose markers and aborted records take
/// offsets). A broker that already dropped records (retention: the mock
/// cluster keeps about 100,000 records or 5 MB per partition) makes the
/// check blind, which is an error, not a loss.
async fn read_all(kafka: &TestKafka, topic: &str) -> Vec<OwnedMessage> {
    let mut last = String::new();
    for _ in 0..3 {
        if let Err(e) = records_in(kafka, topic).await {
            last = e;
            continue;
        }
        match consume_to_end(kafka, topic, Duration::from_secs(300)).await {
            Ok(got) => return got,
            Err(e) => last = e,
        }
    }
    if let Some(secs) = std::env::var("WALBOX_TORTURE_KEEP")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        eprintln!(
            "keeping the broker {} up for {secs} s to look at {topic}",
            kafka.bootstrap()
        );
        tokio::time::sleep(Duration::from_secs(secs)).await;
    }
    panic!("read {topic}: {last}");
}

/// Reads both topics and tallies them against `written` (`n` → the WAL
/// position after its commit, `Lsn::MAX` when unknown).
pub(crate) async fn tally(
    kafka: &TestKafka,
    topic: &str,
    dead_letters: &str,
    written: &BTreeMap<i64, Lsn>,
    expect: Expect<'_>,
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
        if key.starts_with(b"agg-") && key != format!("agg-{}", n % crate::world::KEYS).into_bytes()
        {
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
            if *upper <= (expect.confirmed)(*n) {
                t.confirmed_past += 1;
            }
        }
        if let Some(dead_letter) = expect.dead_letter {
            let belongs_dead = dead_letter(*n);
            if (belongs_dead && seen.contains(n)) || (!belongs_dead && dead.contains(n)) {
                t.misrouted += 1;
            }
        }
    }
    t
}
