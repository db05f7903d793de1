//! The broker round-trips a keyed message with headers, produced the way
//! walbox produces (idempotent, acks=all).

use std::time::Duration;

use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use walbox_test_harness::kafka::{consume_n, consume_until_quiet, headers_of, TestKafka};

async fn round_trip(kafka: &TestKafka) {
    let topic = kafka.create_topic(3).await;
    let producer: FutureProducer = kafka
        .client_config()
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("compression.type", "lz4")
        .create()
        .expect("create producer");

    let mut delivered = Vec::new();
    for (key, id, event_type) in [
        (
            "order-17",
            "6d1f1c9e-0000-4000-8000-000000000001",
            "OrderCreated",
        ),
        (
            "order-17",
            "6d1f1c9e-0000-4000-8000-000000000002",
            "OrderPaid",
        ),
        (
            "cust-9",
            "6d1f1c9e-0000-4000-8000-000000000003",
            "CustomerMoved",
        ),
    ] {
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "id",
                value: Some(id),
            })
            .insert(Header {
                key: "event_type",
                value: Some(event_type),
            });
        let value = format!("{{\"event\": \"{event_type}\"}}");
        let record = FutureRecord::to(&topic)
            .key(key)
            .payload(&value)
            .headers(headers);
        let delivery = producer
            .send(record, Duration::from_secs(10))
            .await
            .unwrap_or_else(|(e, _)| panic!("deliver to {topic}: {e}"));
        delivered.push((key, id, event_type, delivery.partition, delivery.offset));
    }
    // One key, one partition.
    assert_eq!(delivered[0].3, delivered[1].3);

    let messages = consume_n(kafka, &topic, 3, Duration::from_secs(30))
        .await
        .unwrap();
    for (key, id, event_type, partition, offset) in delivered {
        let m = messages
            .iter()
            .find(|m| m.partition() == partition && m.offset() == offset)
            .unwrap_or_else(|| panic!("message at {partition}/{offset} not consumed"));
        assert_eq!(m.key(), Some(key.as_bytes()));
        assert_eq!(
            m.payload(),
            Some(format!("{{\"event\": \"{event_type}\"}}").as_bytes())
        );
        let h = headers_of(m);
        assert_eq!(h.get("id").map(String::as_str), Some(id));
        assert_eq!(h.get("event_type").map(String::as_str), Some(event_type));
    }
    // Per key, offsets follow send order.
    let order17: Vec<i64> = messages
        .iter()
        .filter(|m| m.key() == Some(b"order-17".as_slice()))
        .map(|m| m.offset())
        .collect();
    assert_eq!(order17.len(), 2);
    assert!(order17[0] < order17[1]);

    // Nothing else was published.
    let all = consume_until_quiet(
        kafka,
        &topic,
        Duration::from_secs(1),
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    assert_eq!(all.len(), 3);
}

/// Against the environment's broker: Apache Kafka when `WALBOX_TEST_KAFKA` is set
/// (as in `scripts/test`'s second pass), else the MockCluster.
#[tokio::test]
async fn keyed_message_with_headers_round_trips_through_the_test_broker() {
    round_trip(&TestKafka::from_env()).await;
}

/// Always against the in-process MockCluster, which fault-injection tests use.
#[tokio::test]
async fn keyed_message_with_headers_round_trips_through_the_mock_cluster() {
    let kafka = TestKafka::mock(3);
    round_trip(&kafka).await;
}

#[tokio::test]
async fn consume_n_reports_a_shortfall_instead_of_hanging() {
    let kafka = TestKafka::mock(1);
    let topic = kafka.create_topic(1).await;
    let err = consume_n(&kafka, &topic, 1, Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(err.contains("0 of 1 messages"), "{err}");
}
