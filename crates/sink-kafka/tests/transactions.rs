//! The transactional sink against librdkafka's MockCluster, which speaks
//! the transaction protocol (InitProducerId, AddPartitionsToTxn, EndTxn) but
//! writes no commit/abort markers: what a transaction wrote is visible to
//! every consumer there. These tests check walbox's use of the protocol and
//! the reading back of a compacted topic; isolation itself is the broker's.

use std::time::Duration;

use bytes::Bytes;
use rdkafka::message::Message;
use sink_kafka::{Record, Sink, TxnErrorKind};
use walbox_test_harness::kafka::{consume_n, TestKafka};

use super::{config, pump, record};

const T: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_transaction_commits_its_records_and_the_last_value_per_key_reads_back() {
    let kafka = TestKafka::mock(3);
    let topic = kafka.create_topic(3).await;
    let progress = kafka.create_topic(1).await;
    let mut c = config(&kafka);
    c.transactional_id = Some("walbox-test-commit".into());
    let (sink, mut reports) = Sink::<u64>::new(&c).unwrap();
    sink.init_transactions(T).await.unwrap();
    for round in 0..3u64 {
        sink.begin_transaction().unwrap();
        let mut records: Vec<Record<u64>> = (round * 100..round * 100 + 100)
            .map(|i| record(&topic, i, 7))
            .collect();
        records.push(Record::new(
            &progress,
            Some(Bytes::from("walbox-test-commit")),
            Some(Bytes::from(format!("round {round}"))),
            u64::MAX,
        ));
        records.push(Record::new(
            &progress,
            Some(Bytes::from("another-slot")),
            Some(Bytes::from("theirs")),
            u64::MAX,
        ));
        let got = pump(&sink, &mut reports, records, T).await;
        assert!(got.iter().all(|r| r.result.is_ok()));
        sink.commit_transaction(T).await.unwrap();
    }
    let stored = consume_n(&kafka, &topic, 300, T).await.unwrap();
    assert_eq!(stored.len(), 300);
    let last = sink
        .read_committed_last(&progress, "walbox-test-commit", T)
        .await
        .unwrap();
    assert_eq!(last.as_deref(), Some(&b"round 2"[..]));
    let none = sink
        .read_committed_last(&progress, "nobody", T)
        .await
        .unwrap();
    assert_eq!(none, None);
    let missing = sink
        .read_committed_last("no-such-progress-topic", "walbox-test-commit", T)
        .await
        .unwrap();
    assert_eq!(
        missing, None,
        "a topic that does not exist holds no progress"
    );
    // The mock keeps partition order: the last progress record is the newest.
    let all = consume_n(&kafka, &progress, 6, T).await.unwrap();
    assert_eq!(all.last().unwrap().payload(), Some(&b"theirs"[..]));
}

#[tokio::test]
async fn an_aborted_transaction_can_be_followed_by_a_committed_one() {
    let kafka = TestKafka::mock(1);
    let topic = kafka.create_topic(1).await;
    let mut c = config(&kafka);
    c.transactional_id = Some("walbox-test-abort".into());
    let (sink, mut reports) = Sink::<u64>::new(&c).unwrap();
    sink.init_transactions(T).await.unwrap();
    sink.begin_transaction().unwrap();
    pump(&sink, &mut reports, vec![record(&topic, 1, 1)], T).await;
    sink.abort_transaction(T).await.unwrap();
    sink.begin_transaction().unwrap();
    pump(&sink, &mut reports, vec![record(&topic, 2, 1)], T).await;
    sink.commit_transaction(T).await.unwrap();
}

#[tokio::test]
async fn a_commit_without_a_transaction_is_refused_not_ignored() {
    let kafka = TestKafka::mock(1);
    let mut c = config(&kafka);
    c.transactional_id = Some("walbox-test-state".into());
    let (sink, _reports) = Sink::<u64>::new(&c).unwrap();
    sink.init_transactions(T).await.unwrap();
    let e = sink.commit_transaction(T).await.unwrap_err();
    assert_ne!(e.kind, TxnErrorKind::Retriable, "{e}");
}

#[tokio::test]
async fn a_broker_that_never_answers_transactions_is_unsupported_within_the_timeout() {
    // Nothing listens: no coordinator ever answers.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let mut c = sink_kafka::SinkConfig::new(addr);
    c.transactional_id = Some("walbox-test-nobody".into());
    let (sink, _reports) = Sink::<u64>::new(&c).unwrap();
    let started = std::time::Instant::now();
    let e = sink
        .init_transactions(Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(6));
    assert_eq!(e.kind, TxnErrorKind::Unsupported, "{e}");
}

#[tokio::test]
async fn walbox_sets_the_transactional_id_itself() {
    let kafka = TestKafka::mock(1);
    let c = config(&kafka).set("transactional.id", "mine");
    let e = Sink::<u64>::new(&c).err().expect("refused");
    assert!(e.to_string().contains("transactional.id"), "{e}");
}
