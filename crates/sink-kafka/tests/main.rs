//! sink-kafka against librdkafka's MockCluster (fault injection) and the
//! environment's broker (Apache Kafka in `scripts/test`'s second pass).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use bytes::Bytes;
use rdkafka::message::Message;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use sink_kafka::{
    shutdown, CompactedTopicError, DeliveryErrorKind, Record, Report, Reports, Sink, SinkConfig,
};
use walbox_test_harness::kafka::{consume_n, consume_until_quiet, headers_of, TestKafka};

mod tail;
mod transactions;

/// Sends every record, collecting reports as they come (reports first, as a
/// relay must), then waits for the rest. Returns the reports.
async fn pump(
    sink: &Sink<u64>,
    reports: &mut Reports<u64>,
    records: Vec<Record<u64>>,
    timeout: Duration,
) -> Vec<Report<u64>> {
    let total = records.len();
    let mut out = Vec::with_capacity(total);
    let mut records = records.into_iter().peekable();
    let deadline = tokio::time::Instant::now() + timeout;
    while out.len() < total {
        tokio::select! {
            biased;
            r = reports.next() => out.push(r.expect("reports open")),
            permit = sink.reserve(records.peek().map_or(0, Record::size)), if records.peek().is_some() => {
                sink.send(permit, records.next().unwrap()).await;
            }
            _ = tokio::time::sleep_until(deadline) => panic!("timed out: {} of {total} reports", out.len()),
        }
    }
    out
}

fn record(topic: &str, i: u64, keys: u64) -> Record<u64> {
    Record::new(
        topic,
        Some(Bytes::from(format!("agg-{}", i % keys))),
        Some(Bytes::from(format!(
            "{{\"n\": {i}, \"pad\": \"{}\"}}",
            "x".repeat(150)
        ))),
        i,
    )
    .with_header("id", format!("event-{i}"))
}

fn config(kafka: &TestKafka) -> SinkConfig {
    let mut c = SinkConfig::new(kafka.bootstrap());
    for (k, v) in [
        ("reconnect.backoff.ms", "20"),
        ("reconnect.backoff.max.ms", "500"),
        ("retry.backoff.ms", "20"),
    ] {
        c = c.set(k, v);
    }
    c
}

/// Every token reported exactly once and delivered; per key, offsets strictly
/// increase in send order on one partition.
fn assert_once_in_key_order(reports: &[Report<u64>], n: u64, keys: u64) {
    let mut seen = HashSet::new();
    let mut by_key: BTreeMap<u64, Vec<(u64, i32, i64)>> = BTreeMap::new();
    for r in reports {
        assert!(seen.insert(r.token), "token {} reported twice", r.token);
        let d = r
            .result
            .as_ref()
            .unwrap_or_else(|e| panic!("token {}: {e}", r.token));
        assert!(r.returned.is_none());
        let (partition, offset) = d.kafka().expect("a Kafka delivery");
        by_key
            .entry(r.token % keys)
            .or_default()
            .push((r.token, partition, offset));
    }
    assert_eq!(seen.len() as u64, n);
    for (key, mut deliveries) in by_key {
        deliveries.sort();
        for w in deliveries.windows(2) {
            assert_eq!(w[0].1, w[1].1, "key {key} stays on one partition");
            assert!(
                w[0].2 < w[1].2,
                "key {key}: offsets follow send order: {w:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_thousand_records_with_retriable_errors_are_acked_once_in_key_order() {
    let kafka = TestKafka::mock(3);
    let topic = kafka.create_topic(6).await;
    let mock = kafka.mock_cluster().unwrap();
    let retriable = [
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_LEADER_NOT_AVAILABLE,
    ];
    mock.request_errors(RDKafkaApiKey::Produce, &retriable.repeat(10));

    let (sink, mut reports) = Sink::new(&config(&kafka)).unwrap();
    let n = 100_000;
    let records = (0..n).map(|i| record(&topic, i, 100)).collect();
    let got = pump(&sink, &mut reports, records, Duration::from_secs(120)).await;
    assert_once_in_key_order(&got, n, 100);
    assert_eq!(sink.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_brokers_down_for_ten_seconds_then_everything_arrives_once() {
    let kafka = TestKafka::mock(3);
    let topic = kafka.create_topic(3).await;
    let mock = kafka.mock_cluster().unwrap();
    let (sink, mut reports) = Sink::new(&config(&kafka)).unwrap();

    // Warm up (metadata, producer id), then take every broker down.
    let first = pump(
        &sink,
        &mut reports,
        (0..100).map(|i| record(&topic, i, 10)).collect(),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(first.len(), 100);
    for id in 1..=3 {
        mock.broker_down(id).unwrap();
    }
    let n = 5_000;
    let records: Vec<Record<u64>> = (100..n).map(|i| record(&topic, i, 10)).collect();
    let outage = async {
        tokio::time::sleep(Duration::from_secs(10)).await; // the injected outage itself
        for id in 1..=3 {
            mock.broker_up(id).unwrap();
        }
    };
    let (rest, ()) = tokio::join!(
        pump(&sink, &mut reports, records, Duration::from_secs(90)),
        outage
    );
    let mut all = first;
    all.extend(rest);
    assert_once_in_key_order(&all, n, 10);

    // The broker holds each record once: the idempotent producer's retries did not duplicate.
    let messages = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(2),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let ids: HashSet<String> = messages
        .iter()
        .map(|m| headers_of(m)["id"].clone())
        .collect();
    assert_eq!((messages.len(), ids.len()), (n as usize, n as usize));
}

#[tokio::test]
async fn a_permanent_error_is_reported_as_such() {
    let kafka = TestKafka::mock(1);
    let topic = kafka.create_topic(1).await;
    let mock = kafka.mock_cluster().unwrap();
    // Not gapless (as with a dead-letter topic): each failure is reported as itself.
    let mut c = config(&kafka).set("message.max.bytes", "10000");
    c.gapless = false;
    let (sink, mut reports) = Sink::new(&c).unwrap();

    // Caught before sending: larger than message.max.bytes.
    let big = Record::new(&topic, None, Some(Bytes::from(vec![b'x'; 20_000])), 1u64);
    // Refused by the broker.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED],
    );
    let refused = record(&topic, 2, 1);
    let got = pump(
        &sink,
        &mut reports,
        vec![big, refused],
        Duration::from_secs(30),
    )
    .await;
    let by_token: HashMap<u64, &Report<u64>> = got.iter().map(|r| (r.token, r)).collect();
    let e = by_token[&1].result.as_ref().unwrap_err();
    assert_eq!(e.kind, DeliveryErrorKind::Permanent);
    assert!(
        e.message.contains("exceeds message.max.bytes (10000)"),
        "{e}"
    );
    let e = by_token[&2].result.as_ref().unwrap_err();
    assert_eq!(e.kind, DeliveryErrorKind::Permanent, "{e}");
    assert!(e.message.to_lowercase().contains("authoriz"), "{e}");
}

/// Records are produced through a topic handle made once per topic; a name
/// librdkafka cannot take (a NUL byte) is refused for good, the record
/// handed back whole, and the next topic's records still go out.
#[tokio::test]
async fn a_topic_name_librdkafka_cannot_take_is_refused_for_good() {
    let kafka = TestKafka::mock(1);
    let topic = kafka.create_topic(1).await;
    let mut c = config(&kafka);
    c.gapless = false;
    let (sink, mut reports) = Sink::new(&c).unwrap();
    let bad = record("orders\0evil", 1, 1);
    let mut good: Vec<Record<u64>> = (2..=101).map(|i| record(&topic, i, 3)).collect();
    good.insert(0, bad);
    let got = pump(&sink, &mut reports, good, Duration::from_secs(30)).await;
    let refused = got.iter().find(|r| r.token == 1).unwrap();
    let e = refused.result.as_ref().unwrap_err();
    assert_eq!(e.kind, DeliveryErrorKind::Permanent, "{e}");
    let back = refused.returned.as_ref().expect("the record comes back");
    assert_eq!(&*back.topic, "orders\0evil");
    assert!(back.value.is_some());
    let delivered = got.iter().filter(|r| r.result.is_ok()).count();
    assert_eq!(delivered, 100, "every record of the good topic delivered");
    let stored = consume_n(&kafka, &topic, 100, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(stored.len(), 100);
}

#[tokio::test]
async fn a_permanently_refused_record_comes_back_whole_and_nothing_else_is_produced() {
    let kafka = TestKafka::mock(1);
    let topic = kafka.create_topic(1).await;
    let mock = kafka.mock_cluster().unwrap();
    // Not gapless: records go on after a refusal, as with a dead-letter topic.
    let mut c = config(&kafka).set("message.max.bytes", "10000");
    c.gapless = false;
    let (sink, mut reports) = Sink::new(&c).unwrap();

    let warm = pump(
        &sink,
        &mut reports,
        vec![record(&topic, 0, 1)],
        Duration::from_secs(30),
    )
    .await;
    assert!(warm[0].result.is_ok() && warm[0].returned.is_none());
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED],
    );
    let refused = record(&topic, 1, 1).with_header("event_type", "OrderCreated");
    let big = Record::new(
        &topic,
        Some(Bytes::from_static(b"k")),
        Some(Bytes::from(vec![b'x'; 20_000])),
        2u64,
    );
    // Refused by the broker: the report carries the record as it was sent.
    let got = pump(
        &sink,
        &mut reports,
        vec![refused.clone()],
        Duration::from_secs(30),
    )
    .await;
    let e = got[0].result.as_ref().unwrap_err();
    assert_eq!(e.kind, DeliveryErrorKind::Permanent);
    assert!(e.message.to_lowercase().contains("authoriz"), "{e}");
    let back = got[0].returned.as_ref().expect("the refused record");
    let (sent, _) = refused.split_token();
    assert_eq!(
        (&back.topic, &back.key, &back.value),
        (&sent.topic, &sent.key, &sent.value)
    );
    assert_eq!(back.headers, sent.headers);
    // Refused before producing (too large): the same.
    let got = pump(&sink, &mut reports, vec![big], Duration::from_secs(30)).await;
    assert_eq!(
        got[0].result.as_ref().unwrap_err().kind,
        DeliveryErrorKind::Permanent
    );
    assert_eq!(
        got[0]
            .returned
            .as_ref()
            .unwrap()
            .value
            .as_ref()
            .unwrap()
            .len(),
        20_000
    );
    // Reports only report: the topic holds the warm-up record alone.
    let all = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(1),
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    assert_eq!(all.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_producer_queue_blocks_and_resumes_without_loss() {
    tiny_queue_blocks_and_resumes().await;
}

/// walbox's runtime: one thread, which also serves the producer's delivery
/// reports. A sender waiting for queue room must let them be served.
#[tokio::test(flavor = "current_thread")]
async fn a_tiny_producer_queue_blocks_and_resumes_on_one_thread() {
    tiny_queue_blocks_and_resumes().await;
}

async fn tiny_queue_blocks_and_resumes() {
    let kafka = TestKafka::mock(1);
    let topic = kafka.create_topic(2).await;
    let c = config(&kafka)
        .set("queue.buffering.max.messages", "5")
        .set("linger.ms", "0");
    let (sink, mut reports) = Sink::new(&c).unwrap();
    let n = 5_000;
    let got = pump(
        &sink,
        &mut reports,
        (0..n).map(|i| record(&topic, i, 7)).collect(),
        Duration::from_secs(60),
    )
    .await;
    assert_once_in_key_order(&got, n, 7);
}

/// A one-broker mock cluster that answers "unknown topic" for `topic`.
fn mock_without(topic: &str) -> TestKafka {
    let kafka = TestKafka::mock(1);
    kafka
        .mock_cluster()
        .unwrap()
        .topic_error(
            topic,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART,
        )
        .unwrap();
    kafka
}

#[tokio::test]
async fn an_unknown_topic_is_a_permanent_error_after_a_short_wait() {
    let topic = "walbox-no-such-topic";
    let kafka = mock_without(topic);
    let (sink, mut reports) = Sink::new(&config(&kafka)).unwrap();
    let started = std::time::Instant::now();
    let got = pump(
        &sink,
        &mut reports,
        vec![record(topic, 1, 1)],
        Duration::from_secs(30),
    )
    .await;
    let e = got[0].result.as_ref().unwrap_err();
    assert_eq!(e.kind, DeliveryErrorKind::Permanent);
    assert!(
        e.message
            .contains("topic walbox-no-such-topic does not exist")
            && e.message.contains("topics.create"),
        "{e}"
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(5) && waited < Duration::from_secs(15),
        "refused after the 5 s grace, not at once and not never: {waited:?}"
    );
    // The next records for it are refused at once: a stream of them does
    // not wait out the grace one by one.
    let started = std::time::Instant::now();
    let got = pump(
        &sink,
        &mut reports,
        (2..12).map(|i| record(topic, i, 1)).collect(),
        Duration::from_secs(30),
    )
    .await;
    assert!(got.iter().all(|r| r.result.is_err()));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_topic_created_seconds_after_its_first_record_is_waited_for() {
    let topic = "walbox-late-topic";
    let kafka = mock_without(topic);
    let mock = kafka.mock_cluster().unwrap();
    let (sink, mut reports) = Sink::new(&config(&kafka)).unwrap();
    let send = pump(
        &sink,
        &mut reports,
        vec![record(topic, 1, 1)],
        Duration::from_secs(30),
    );
    let create = async {
        tokio::time::sleep(Duration::from_secs(2)).await; // the operator is a little late
                                                          // (The mock made the topic when told to fail it; clearing the
                                                          // error is its "created".)
        mock.topic_error(topic, RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR)
            .unwrap();
    };
    let (got, ()) = tokio::join!(send, create);
    assert!(got[0].result.is_ok(), "{:?}", got[0].result);
}

#[tokio::test]
async fn shutdown_accounts_for_every_record_in_flight() {
    let kafka = TestKafka::mock(1);
    let topic = kafka.create_topic(1).await;
    let mock = kafka.mock_cluster().unwrap();
    let (sink, mut reports) = Sink::new(&config(&kafka)).unwrap();
    let warm = pump(
        &sink,
        &mut reports,
        vec![record(&topic, 0, 1)],
        Duration::from_secs(30),
    )
    .await;
    assert!(warm[0].result.is_ok());
    mock.broker_down(1).unwrap();
    for i in 1..=50 {
        let r = record(&topic, i, 1);
        let permit = sink.reserve(r.size()).await;
        sink.send(permit, r).await;
    }
    assert_eq!(sink.in_flight(), 50);
    let last = shutdown(sink, reports, Duration::from_secs(1)).await;
    let tokens: HashSet<u64> = last.iter().map(|r| r.token).collect();
    assert_eq!(tokens, (1..=50).collect(), "every record reported");
    for r in &last {
        assert_eq!(
            r.result.as_ref().unwrap_err().kind,
            DeliveryErrorKind::Purged,
            "token {}",
            r.token
        );
    }
}

/// Against the environment's broker: Apache Kafka in `scripts/test`'s second pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_records_with_headers_and_timestamps_round_trip_through_the_broker() {
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let (sink, mut reports) = Sink::new(&config(&kafka)).unwrap();
    let n = 2_000;
    let records = (0..n)
        .map(|i| record(&topic, i, 20).with_timestamp_ms(1_700_000_000_000 + i as i64))
        .collect();
    let got = pump(&sink, &mut reports, records, Duration::from_secs(60)).await;
    assert_once_in_key_order(&got, n, 20);
    let messages = consume_n(&kafka, &topic, n as usize, Duration::from_secs(60))
        .await
        .unwrap();
    for m in &messages {
        let id = headers_of(m)["id"].clone();
        let i: u64 = id.strip_prefix("event-").unwrap().parse().unwrap();
        assert_eq!(m.key(), Some(format!("agg-{}", i % 20).as_bytes()));
        assert_eq!(
            m.timestamp().to_millis(),
            Some(1_700_000_000_000 + i as i64)
        );
        assert!(std::str::from_utf8(m.payload().unwrap())
            .unwrap()
            .starts_with(&format!("{{\"n\": {i},")));
    }
}

/// Warms the producer up on a topic of its own (connected, metadata
/// known), then takes the one-broker MockCluster down.
async fn warm_then_down(kafka: &TestKafka, sink: &Sink<u64>, reports: &mut Reports<u64>) {
    let warm = kafka.create_topic(1).await;
    let first = pump(
        sink,
        reports,
        vec![record(&warm, 0, 1)],
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(first.len(), 1);
    kafka.mock_cluster().unwrap().broker_down(1).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_topics_during_an_outage_cost_one_topic_check_not_one_each() {
    let kafka = TestKafka::mock(1);
    let topics = [
        kafka.create_topic(1).await,
        kafka.create_topic(1).await,
        kafka.create_topic(1).await,
        kafka.create_topic(1).await,
        kafka.create_topic(1).await,
    ];
    let mock = kafka.mock_cluster().unwrap();
    let (sink, mut reports) = Sink::new(&config(&kafka)).unwrap();
    warm_then_down(&kafka, &sink, &mut reports).await;
    let started = std::time::Instant::now();
    for (i, topic) in topics.iter().enumerate() {
        let r = record(topic, i as u64 + 1, 1);
        let permit = sink.reserve(r.size()).await;
        sink.send(permit, r).await;
    }
    let blocked = started.elapsed();
    // One 5 s check at most; five of them (25 s) was the bug.
    assert!(
        blocked < Duration::from_secs(12),
        "sending to 5 new topics during the outage blocked for {blocked:?}"
    );
    mock.broker_up(1).unwrap();
    let mut got = Vec::new();
    while got.len() < topics.len() {
        let report = tokio::time::timeout(Duration::from_secs(60), reports.next())
            .await
            .expect("reports after the broker came back")
            .unwrap();
        assert!(report.result.is_ok(), "{:?}", report.result);
        got.push(report.token);
    }
    got.sort_unstable();
    assert_eq!(got, [1, 2, 3, 4, 5]);
}

/// Exactly-once's progress topic is checked before streaming: with no
/// broker answering, the check says "no answer" (the caller asks again),
/// never "refused" (which stops walbox for good); back up, it passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compacted_topic_check_without_a_broker_is_unanswered_not_refused() {
    let kafka = TestKafka::mock(1);
    let progress = kafka.create_topic(1).await;
    let mock = kafka.mock_cluster().unwrap();
    let (sink, mut reports) = Sink::<u64>::new(&config(&kafka)).unwrap();
    warm_then_down(&kafka, &sink, &mut reports).await;
    match sink.ensure_compacted_topic(&progress).await {
        Err(CompactedTopicError::Unanswered(why)) => {
            assert!(why.contains("no broker answered"), "{why}");
            assert!(why.contains(&progress), "{why}");
        }
        other => panic!("with every broker down: {other:?}"),
    }
    mock.broker_up(1).unwrap();
    // The MockCluster describes no configurations: a warning, and through.
    let back = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match sink.ensure_compacted_topic(&progress).await {
                Err(CompactedTopicError::Unanswered(_)) => {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                done => return done,
            }
        }
    })
    .await
    .expect("the broker answers again");
    assert_eq!(back, Ok(()));
}

/// The Java client's murmur2 (Kafka's `Utils.murmur2`), written here from its
/// definition: seed 0x9747b28c, m = 0x5bd1e995, r = 24, little-endian 4-byte
/// blocks, the tail folded in, then the final mix.
fn java_murmur2(data: &[u8]) -> i32 {
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let mut h: u32 = 0x9747_b28c ^ data.len() as u32;
    let mut blocks = data.chunks_exact(4);
    for b in &mut blocks {
        let mut k = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = blocks.remainder();
    if !tail.is_empty() {
        for (i, byte) in tail.iter().enumerate().rev() {
            h ^= u32::from(*byte) << (8 * i);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The Java client's partition for a key: `toPositive(murmur2(key)) % n`.
fn java_partition(key: &[u8], partitions: i32) -> i32 {
    (java_murmur2(key) & 0x7fff_ffff) % partitions
}

#[test]
fn the_reference_murmur2_matches_kafkas_own_vectors() {
    // Kafka's UtilsTest.testMurmur2.
    for (input, expected) in [
        (&b"21"[..], -973_932_308),
        (b"foobar", -790_332_482),
        (b"a-little-bit-long-string", -985_981_536),
        (b"a-little-bit-longer-string", -1_486_304_829),
        (
            b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
            -58_897_971,
        ),
        (b"abc", 479_470_107),
    ] {
        assert_eq!(
            java_murmur2(input),
            expected,
            "{}",
            String::from_utf8_lossy(input)
        );
    }
}

/// Switching from Debezium (or any JVM producer) keeps each aggregate on its
/// partition: walbox's default partitioner places keys where the Java
/// client does.
#[tokio::test]
async fn keys_land_on_the_partitions_the_java_client_chooses() {
    let kafka = TestKafka::mock(1);
    let partitions = 12;
    let topic = kafka.create_topic(partitions).await;
    let (sink, mut reports) = Sink::new(&config(&kafka)).unwrap();
    let keys: Vec<String> = (0..200)
        .map(|i| format!("order-{i}"))
        .chain(
            [
                "21",
                "foobar",
                "a-little-bit-long-string",
                "ünïcødé-aggregate",
            ]
            .map(String::from),
        )
        .collect();
    let records = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            Record::new(
                &topic,
                Some(Bytes::from(k.clone())),
                Some(Bytes::from("{}")),
                i as u64,
            )
        })
        .collect();
    let got = pump(&sink, &mut reports, records, Duration::from_secs(30)).await;
    let mut spread = HashSet::new();
    for r in got {
        let key = keys[r.token as usize].as_bytes();
        let (partition, _) = r.result.expect("delivered").kafka().expect("on Kafka");
        assert_eq!(
            partition,
            java_partition(key, partitions),
            "key {}",
            String::from_utf8_lossy(key)
        );
        spread.insert(partition);
    }
    assert!(spread.len() > 6, "the keys spread over the partitions");
}

/// The librdkafka walbox ships is built with TLS (OpenSSL, static), SASL
/// PLAIN/SCRAM/OAUTHBEARER, zstd, gzip, snappy and lz4: a producer with each
/// is created, and each compression delivers through the broker.
#[tokio::test]
async fn secured_and_compressed_producers_are_supported() {
    for props in [
        &[("security.protocol", "SSL")][..],
        &[
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "walbox"),
            ("sasl.password", "pw"),
        ],
        &[
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "SCRAM-SHA-256"),
            ("sasl.username", "walbox"),
            ("sasl.password", "pw"),
        ],
        &[
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "PLAIN"),
            ("sasl.username", "walbox"),
            ("sasl.password", "pw"),
        ],
        &[
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "OAUTHBEARER"),
        ],
    ] {
        let mut c = SinkConfig::new("127.0.0.1:1");
        for (k, v) in props {
            c = c.set(*k, *v);
        }
        if let Err(e) = Sink::<u64>::new(&c) {
            panic!("{props:?}: {e}");
        }
    }
    let kafka = TestKafka::mock(1);
    for codec in ["zstd", "gzip", "snappy", "lz4"] {
        let topic = kafka.create_topic(1).await;
        let (sink, mut reports) =
            Sink::new(&config(&kafka).set("compression.type", codec)).unwrap();
        let got = pump(
            &sink,
            &mut reports,
            (0..50).map(|i| record(&topic, i, 5)).collect(),
            Duration::from_secs(30),
        )
        .await;
        assert!(got.iter().all(|r| r.result.is_ok()), "{codec}");
        let read = consume_n(&kafka, &topic, 50, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(read.len(), 50, "{codec}");
    }
}

/// Consumes the topic until quiet; the `n` of every stored record, in offset order.
async fn stored_ns(kafka: &TestKafka, topic: &str) -> Vec<u64> {
    let all = consume_until_quiet(
        kafka,
        topic,
        Duration::from_secs(2),
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    all.iter()
        .map(|m| {
            headers_of(m)["id"]
                .trim_start_matches("event-")
                .parse()
                .unwrap()
        })
        .collect()
}

/// One record per request and several requests in flight: a failure of one
/// is followed by requests already on the wire.
fn pipelined(kafka: &TestKafka) -> SinkConfig {
    config(kafka)
        .set("linger.ms", "0")
        .set("batch.num.messages", "1")
        .set("message.max.bytes", "10000")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_broker_refuses_a_record_for_good_no_later_record_of_its_partition_is_written() {
    let kafka = TestKafka::mock(1);
    let topic = kafka.create_topic(1).await;
    let mock = kafka.mock_cluster().unwrap();
    // A real broker also refuses the request that follows a failed one on
    // the wire (its sequence number leaves a gap); the mock checks sequences
    // only for transactional producers and stores it. So one request is on
    // the wire at a time, and what is shown is the producer's side: the one
    // record that may have been on the wire aside, nothing queued behind
    // the failure is ever sent (without the gapless guarantee librdkafka
    // renumbers the queue and sends it all).
    let c = pipelined(&kafka).set("max.in.flight.requests.per.connection", "1");
    let (sink, mut reports) = Sink::new(&c).unwrap();
    let warm = pump(
        &sink,
        &mut reports,
        (0..5).map(|i| record(&topic, i, 1)).collect(),
        Duration::from_secs(30),
    )
    .await;
    assert!(warm.iter().all(|r| r.result.is_ok()));

    // The next Produce request (record 5) is refused for good.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    let got = pump(
        &sink,
        &mut reports,
        (5..40).map(|i| record(&topic, i, 1)).collect(),
        Duration::from_secs(30),
    )
    .await;
    let by_token: HashMap<u64, &Report<u64>> = got.iter().map(|r| (r.token, r)).collect();
    let first = by_token[&5].result.as_ref().unwrap_err();
    assert_eq!(first.kind, DeliveryErrorKind::Permanent, "{first}");
    for i in 7..40 {
        assert!(
            by_token[&i].result.is_err(),
            "record {i} was delivered after record 5 failed for good"
        );
    }
    let stored = stored_ns(&kafka, &topic).await;
    assert!(
        stored == [0, 1, 2, 3, 4] || stored == [0, 1, 2, 3, 4, 6],
        "nothing queued behind the refused record is stored: {stored:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_record_fails_before_producing_no_later_record_is_written() {
    let kafka = TestKafka::mock(1);
    let topic = kafka.create_topic(1).await;
    let (sink, mut reports) = Sink::new(&pipelined(&kafka)).unwrap();
    let mut records: Vec<Record<u64>> = (0..5).map(|i| record(&topic, i, 1)).collect();
    // Record 5 is larger than message.max.bytes: refused before it is produced.
    records.push(Record::new(
        &topic,
        Some(Bytes::from_static(b"agg-0")),
        Some(Bytes::from(vec![b'x'; 20_000])),
        5u64,
    ));
    records.extend((6..20).map(|i| record(&topic, i, 1)));
    let got = pump(&sink, &mut reports, records, Duration::from_secs(30)).await;
    let by_token: HashMap<u64, &Report<u64>> = got.iter().map(|r| (r.token, r)).collect();
    assert_eq!(
        by_token[&5].result.as_ref().unwrap_err().kind,
        DeliveryErrorKind::Permanent
    );
    for i in 6..20 {
        let e = by_token[&i].result.as_ref().unwrap_err();
        assert_eq!(e.kind, DeliveryErrorKind::Withheld, "record {i}: {e}");
        assert!(by_token[&i].returned.is_none());
    }
    let stored = stored_ns(&kafka, &topic).await;
    assert!(
        stored.iter().all(|n| *n < 5),
        "nothing after the refused record is stored: {stored:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_dead_letters_records_after_a_permanent_failure_are_still_written() {
    let kafka = TestKafka::mock(1);
    let topic = kafka.create_topic(1).await;
    let mut c = pipelined(&kafka);
    c.gapless = false;
    let (sink, mut reports) = Sink::new(&c).unwrap();
    let mut records: Vec<Record<u64>> = (0..5).map(|i| record(&topic, i, 1)).collect();
    records.push(Record::new(
        &topic,
        Some(Bytes::from_static(b"agg-0")),
        Some(Bytes::from(vec![b'x'; 20_000])),
        5u64,
    ));
    records.extend((6..20).map(|i| record(&topic, i, 1)));
    let got = pump(&sink, &mut reports, records, Duration::from_secs(30)).await;
    assert_eq!(got.iter().filter(|r| r.result.is_ok()).count(), 19);
    let expected: Vec<u64> = (0..20).filter(|n| *n != 5).collect();
    assert_eq!(stored_ns(&kafka, &topic).await, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_enough_replicas_is_retried_and_shows_as_a_stall() {
    let kafka = TestKafka::mock(1);
    let topic = kafka.create_topic(1).await;
    let mock = kafka.mock_cluster().unwrap();
    let c = config(&kafka)
        .set("retry.backoff.ms", "100")
        .set("retry.backoff.max.ms", "100");
    let (sink, mut reports) = Sink::new(&c).unwrap();
    let warm = pump(
        &sink,
        &mut reports,
        vec![record(&topic, 0, 1)],
        Duration::from_secs(30),
    )
    .await;
    assert!(warm[0].result.is_ok());
    assert_eq!(sink.stalled_for(), Duration::ZERO, "nothing in flight");

    // About three seconds of "below min.insync.replicas".
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS; 30],
    );
    let watch = async {
        let mut longest = Duration::ZERO;
        for _ in 0..100 {
            longest = longest.max(sink.stalled_for());
            tokio::time::sleep(Duration::from_millis(50)).await; // sampling the stall
        }
        longest
    };
    let send = pump(
        &sink,
        &mut reports,
        (1..20).map(|i| record(&topic, i, 1)).collect(),
        Duration::from_secs(60),
    );
    let (got, longest) = tokio::join!(send, watch);
    assert!(
        longest >= Duration::from_secs(1),
        "the retries showed as a stall: longest {longest:?}"
    );
    assert_once_in_key_order(&got, 19, 1);
    assert_eq!(sink.stalled_for(), Duration::ZERO);
    assert_eq!(stored_ns(&kafka, &topic).await, (0..20).collect::<Vec<_>>());
}

/// A token endpoint on a local port: answers every POST with `status` and
/// `body`, and keeps each request's head and body.
struct TokenEndpoint {
    url: String,
    requests: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl TokenEndpoint {
    fn start(status: &'static str, body: &'static str) -> TokenEndpoint {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/oauth2/token", listener.local_addr().unwrap());
        let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = std::sync::Arc::clone(&requests);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut head = String::new();
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                    head.push_str(&line);
                }
                let mut content = vec![0; length];
                let _ = reader.read_exact(&mut content);
                seen.lock()
                    .unwrap()
                    .push(format!("{head}\r\n{}", String::from_utf8_lossy(&content)));
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        TokenEndpoint { url, requests }
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }
}

fn oidc_config(endpoint: &TokenEndpoint) -> SinkConfig {
    SinkConfig::new("127.0.0.1:1")
        .set("security.protocol", "SASL_PLAINTEXT")
        .set("sasl.mechanism", "OAUTHBEARER")
        .set("sasl.oauthbearer.method", "oidc")
        .set("sasl.oauthbearer.client.id", "walbox-client")
        .set("sasl.oauthbearer.client.secret", "hunter2-oidc")
        .set("sasl.oauthbearer.scope", "kafka.produce")
        .set("sasl.oauthbearer.token.endpoint.url", &endpoint.url)
}

/// No broker here checks OAUTHBEARER tokens, so what is shown is walbox's
/// side: the built-in librdkafka has the OIDC method, and asks the token
/// endpoint for a token with the client credentials grant.
#[tokio::test]
async fn oauthbearer_oidc_asks_the_token_endpoint_with_client_credentials() {
    // An unsigned JWT (header {"alg":"none"}, subject "walbox", far expiry).
    let endpoint = TokenEndpoint::start(
        "200 OK",
        r#"{"access_token":"eyJhbGciOiJub25lIn0.eyJzdWIiOiJ3YWxib3giLCJleHAiOjQxMDI0NDQ4MDAsImlhdCI6MTcwMDAwMDAwMH0.","token_type":"bearer","expires_in":3600}"#,
    );
    let (sink, _reports) = Sink::<u64>::new(&oidc_config(&endpoint)).expect("OIDC is built in");
    walbox_test_harness::wait::wait_for("a token request", Duration::from_secs(20), || {
        let n = endpoint.requests().len();
        async move {
            if n > 0 {
                Ok(())
            } else {
                Err("none yet".to_owned())
            }
        }
    })
    .await;
    let request = &endpoint.requests()[0];
    assert!(request.starts_with("POST /oauth2/token"), "{request}");
    // HTTP Basic with client id and secret, as RFC 6749 section 2.3.1 has it.
    assert!(
        request.contains("Authorization: Basic d2FsYm94LWNsaWVudDpodW50ZXIyLW9pZGM="),
        "{request}"
    );
    assert!(
        request.contains("grant_type=client_credentials"),
        "{request}"
    );
    assert!(request.contains("scope=kafka.produce"), "{request}");
    drop(sink);
}

#[tokio::test]
async fn a_token_endpoint_that_refuses_the_client_is_a_definite_refusal_without_the_secret() {
    let endpoint = TokenEndpoint::start(
        "401 Unauthorized",
        r#"{"error":"invalid_client","error_description":"bad secret hunter2-oidc"}"#,
    );
    let (sink, _reports) = Sink::<u64>::new(&oidc_config(&endpoint)).unwrap();
    let e = sink
        .check_brokers(Duration::from_secs(10))
        .await
        .expect_err("refused");
    let text = e.to_string();
    assert!(matches!(e, sink_kafka::SinkError::Refused(_)), "{text}");
    assert!(!text.contains("hunter2-oidc"), "{text}");
    assert!(
        text.contains("OAUTHBEARER token") && text.contains("sasl.oauthbearer.client.secret"),
        "{text}"
    );
}
