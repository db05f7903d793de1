//! Topics walbox creates (`topics.create`), against Apache Kafka itself
//! (`WALBOX_KAFKA_LIBS`; the MockCluster has no CreateTopics), with its
//! automatic topic creation off, as production clusters run.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use walbox_test_harness::kafka::{consume_n, headers_of, TestKafka};
use walbox_test_harness::pg::fresh_db;

use crate::support::{
    expect_all, init, insert_events, kafka_cluster, spawn_run, stop, wait_broker,
};

fn partitions_of(kafka: &TestKafka, topic: &str) -> usize {
    let c: BaseConsumer = kafka.client_config().create().unwrap();
    let md = c
        .fetch_metadata(Some(topic), Duration::from_secs(5))
        .unwrap();
    md.topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map_or(0, |t| t.partitions().len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_event_and_dead_letter_topics_are_created_when_allowed() {
    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    wait_broker(&kafka).await;
    let db = fresh_db().await;
    let client = init(&db).await;
    let prefix = walbox_test_harness::unique_name("created").replace('_', "-");
    let template = format!("{prefix}.{{aggregate_type}}");
    let dead_letters = format!("{prefix}.dead-letters");
    let mut relay = spawn_run(
        &db,
        &kafka,
        &[
            "--mapping-topic-template",
            &template,
            "--dead-letter-topic",
            &dead_letters,
            "--topics-create",
            "true",
            "--topics-partitions",
            "3",
            "--topics-config",
            "retention.ms=604800000",
        ],
    );
    // insert_events writes aggregate type 'order'.
    insert_events(&client, 0, 60, |_| 6, 6).await;
    // One row the mapping cannot take (an empty aggregate id): a dead letter.
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', '', 'Broken', '{\"n\": 60}')",
        )
        .await
        .unwrap();
    let topic = format!("{prefix}.order");
    expect_all(&kafka, &topic, 60).await;
    assert_eq!(partitions_of(&kafka, &topic), 3);
    let dead = consume_n(&kafka, &dead_letters, 1, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(headers_of(&dead[0])["walbox.error.kind"], "unmappable");
    let log = stop(&mut relay).await;
    assert!(log.contains("created topic"), "{log}");
    // The settings given are the topic's own.
    let described = tokio::task::block_in_place(|| {
        cluster.tool(
            "org.apache.kafka.tools.TopicCommand",
            &[
                "--bootstrap-server",
                &cluster.bootstrap(),
                "--describe",
                "--topic",
                &topic,
            ],
            b"",
        )
    });
    assert!(described.contains("retention.ms=604800000"), "{described}");
}
