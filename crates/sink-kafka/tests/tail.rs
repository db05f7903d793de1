//! Reading a topic back from its end ([`sink_core::tail::TailReader`]), on
//! the environment's broker (Apache Kafka in `scripts/test`'s second
//! pass): the records the sink marked with their origin are found exactly,
//! other streams' and histories' passed over, and the look-back stops at
//! the first confirmed record of the stream.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use sink_core::tail::{Tail, TailQuery, TailReader};
use sink_core::Origin;
use sink_kafka::{Record, Sink};
use walbox_test_harness::kafka::TestKafka;

use super::{config, pump, record};

const HISTORY: u64 = 0x1234;

fn marked(
    topic: &str,
    i: u64,
    stream: &str,
    history: u64,
    position: u64,
    index: u64,
) -> Record<u64> {
    record(topic, i, 5).with_origin(Origin {
        stream: Arc::from(stream),
        history,
        position,
        index,
        commit_time: 1_700_000_000_000_000 + position as i64,
    })
}

fn query(since: u64, look_back: u64) -> TailQuery {
    TailQuery {
        stream: "walbox".into(),
        history: HISTORY,
        since,
        look_back,
    }
}

fn found(tail: &Tail) -> BTreeSet<(u64, u64)> {
    tail.found.iter().map(|f| (f.position, f.index)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_follows_the_confirmed_position_is_found_exactly() {
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let (sink, mut reports) = Sink::<u64>::new(&config(&kafka)).unwrap();
    // Transactions at 100 (confirmed) then 200 and 300 (not), 20 events
    // each over 5 keys; between them, another slot's, another history's
    // and unmarked records.
    let mut records = Vec::new();
    let mut i = 0;
    for position in [100u64, 200, 300] {
        for index in 0..20 {
            records.push(marked(&topic, i, "walbox", HISTORY, position, index));
            records.push(marked(&topic, i + 1, "walbox-2", HISTORY, position, index));
            records.push(marked(&topic, i + 2, "walbox", 0x9999, position, index));
            records.push(record(&topic, i + 3, 5));
            i += 4;
        }
    }
    let reports = pump(&sink, &mut reports, records, Duration::from_secs(60)).await;
    assert!(reports.iter().all(|r| r.result.is_ok()));

    let tail = sink.read_tail(&topic, &query(200, 100_000)).await.unwrap();
    let want: BTreeSet<(u64, u64)> = [200u64, 300]
        .into_iter()
        .flat_map(|p| (0..20).map(move |i| (p, i)))
        .collect();
    assert_eq!(found(&tail), want);
    assert_eq!(tail.partitions, 3);
    assert!(tail.cut_short.is_empty(), "{tail:?}");
    // Each where the sink's report put it.
    for f in &tail.found {
        let token = reports
            .iter()
            .find(|r| r.result.as_ref().unwrap().kafka() == f.at.kafka())
            .map(|r| r.token)
            .unwrap();
        assert_eq!(token % 4, 0, "one of this stream's records");
    }
    let none = sink.read_tail(&topic, &query(400, 100_000)).await.unwrap();
    assert!(none.found.is_empty(), "everything confirmed");
}

/// The look-back ends in the chunk where a confirmed record of the stream
/// is: 1,500 confirmed records before 10 unconfirmed ones cost one chunk
/// (500 records), not the partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_look_back_stops_at_a_confirmed_record() {
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let (sink, mut reports) = Sink::<u64>::new(&config(&kafka)).unwrap();
    let records = (0..1_510)
        .map(|i| {
            let position = if i < 1_500 { 100 + i } else { 5_000 };
            marked(&topic, i, "walbox", HISTORY, position, i)
        })
        .collect();
    pump(&sink, &mut reports, records, Duration::from_secs(60)).await;
    let tail = sink
        .read_tail(&topic, &query(2_000, 100_000))
        .await
        .unwrap();
    assert_eq!(found(&tail), (1_500..1_510).map(|i| (5_000, i)).collect());
    assert_eq!(tail.read, 500);
    assert!(tail.cut_short.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_look_back_is_bounded_and_says_where_it_ended() {
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let (sink, mut reports) = Sink::<u64>::new(&config(&kafka)).unwrap();
    let records = (0..50)
        .map(|i| marked(&topic, i, "walbox", HISTORY, 500, i))
        .collect();
    pump(&sink, &mut reports, records, Duration::from_secs(60)).await;
    let tail = sink.read_tail(&topic, &query(100, 10)).await.unwrap();
    assert_eq!(tail.read, 10);
    assert_eq!(found(&tail), (40..50).map(|i| (500, i)).collect());
    assert_eq!(tail.cut_short, [0]);
    let absent = sink
        .read_tail("walbox-no-such-topic", &query(100, 10))
        .await
        .unwrap();
    assert_eq!(absent, Tail::default());
}

/// What the read costs a start, by partition count (run by hand, against
/// Apache Kafka: `WALBOX_TEST_KAFKA=host:port cargo test -p sink-kafka
/// --release --test main tail_read_cost -- --ignored --nocapture`; figures
/// in docs/benchmarks.md). Each partition holds 200 confirmed records of
/// the stream, then 20 it must find. Prints; asserts only what was found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand against Apache Kafka"]
async fn tail_read_cost() {
    let kafka = TestKafka::from_env();
    for partitions in [1u64, 100, 1_000] {
        let topic = kafka.create_topic(partitions as i32).await;
        let (sink, mut reports) = Sink::<u64>::new(&config(&kafka)).unwrap();
        let mut records = Vec::new();
        let mut i = 0;
        for (position, per_partition) in [(100u64, 200u64), (900, 20)] {
            for index in 0..per_partition * partitions {
                let r = marked(&topic, i, "walbox", HISTORY, position, index);
                // Spread evenly: one key per partition's worth.
                let r = Record { key: None, ..r };
                records.push(r);
                i += 1;
            }
        }
        pump(&sink, &mut reports, records, Duration::from_secs(300)).await;
        let began = std::time::Instant::now();
        let tail = sink.read_tail(&topic, &query(500, 100_000)).await.unwrap();
        let took = began.elapsed();
        assert_eq!(tail.found.len() as u64, 20 * partitions);
        eprintln!(
            "{partitions} partitions: {} records read, {} found, {took:?}",
            tail.read,
            tail.found.len()
        );
    }
}
