//! Back-pressure the application can see (`walbox.require_capacity()`,
//! migration 0007) on Apache Kafka (`WALBOX_KAFKA_LIBS`): while the broker
//! is frozen (SIGSTOP) and events wait, the function refuses writes with
//! SQLSTATE WB001 once the oldest waits longer than `backlog.max_age`, the
//! metric says so, and both clear once the broker acknowledges them; with
//! no walbox streaming it refuses with WB002.

use std::time::Duration;

use walbox_test_harness::apache_kafka::KafkaCluster;
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::wait::wait_for;

use crate::support::*;

/// `walbox.require_capacity()`'s SQLSTATE, `None` when it lets the write
/// through.
async fn capacity(client: &tokio_postgres::Client) -> Option<String> {
    match client
        .execute("SELECT walbox.require_capacity()", &[])
        .await
    {
        Ok(_) => None,
        Err(e) => Some(
            e.as_db_error()
                .map(|d| format!("{} {}", d.code().code(), d.message()))
                .unwrap_or_else(|| e.to_string()),
        ),
    }
}

async fn wait_capacity(client: &tokio_postgres::Client, want: Option<&str>, within: Duration) {
    wait_for(
        &format!("require_capacity() to answer {want:?}"),
        within,
        || async move {
            let got = capacity(client).await;
            match (&got, want) {
                (None, None) => Ok(()),
                (Some(g), Some(w)) if g.starts_with(w) => Ok(()),
                _ => Err(format!("{got:?}")),
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_capacity_refuses_while_the_broker_holds_events_and_lets_through_once_they_land() {
    let cluster = tokio::task::block_in_place(|| KafkaCluster::start(1));
    let kafka = cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(1).await;

    // No walbox: writes are refused, as waiting.
    let none = capacity(&client).await.expect("refused");
    assert!(none.starts_with("WB002"), "{none}");

    let relay = spawn_run(
        &db,
        &kafka,
        &[
            "--mapping-topic-template",
            &topic,
            "--backlog-max-age",
            "3s",
            "--metrics-addr",
            ANY_PORT,
        ],
    );
    let addr = metrics_addr(&relay).await;
    wait_capacity(&client, None, Duration::from_secs(30)).await;
    insert_events(&client, 0, 20, |_| 5, 4).await;
    assert_eq!(expect_all(&kafka, &topic, 20).await, 0);
    assert_eq!(metric_at(&addr, "walbox_backlog_over_budget"), 0.0);

    // The broker frozen: events wait; past 3 s the budget is spent.
    cluster.pause(0);
    insert_events(&client, 20, 30, |_| 5, 4).await;
    wait_capacity(&client, Some("WB001"), Duration::from_secs(30)).await;
    let refused = capacity(&client).await.unwrap();
    assert!(refused.contains("over its budget"), "{refused}");
    let row = client
        .query_one(
            "SELECT streaming, oldest_undelivered_age >= interval '3 seconds', over_budget,
                    max_age = interval '3 seconds', unconfirmed_bytes > 0
               FROM walbox.backlog()",
            &[],
        )
        .await
        .unwrap();
    for i in 0..5 {
        assert!(row.get::<_, bool>(i), "column {i} of walbox.backlog()");
    }
    wait_for(
        "the metric to say over budget",
        Duration::from_secs(10),
        || {
            let v = metric_at(&addr, "walbox_backlog_over_budget");
            async move { (v == 1.0).then_some(()).ok_or(v.to_string()) }
        },
    )
    .await;

    // The broker back: what waited lands, and writes pass again.
    cluster.resume(0);
    assert_eq!(expect_all(&kafka, &topic, 30).await, 0);
    wait_capacity(&client, None, Duration::from_secs(60)).await;
    wait_for("the metric to clear", Duration::from_secs(10), || {
        let v = metric_at(&addr, "walbox_backlog_over_budget");
        async move { (v == 0.0).then_some(()).ok_or(v.to_string()) }
    })
    .await;

    // Stopped: refused again, as not streaming.
    let mut relay = relay;
    stop(&mut relay).await;
    wait_capacity(&client, Some("WB002"), Duration::from_secs(10)).await;
}

/// A budget where `walbox migrate` did not install the functions that
/// enforce it is refused at start, in one line.
#[tokio::test]
async fn a_budget_without_the_functions_is_refused_at_start() {
    let db = fresh_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "CREATE TABLE outbox_events (id uuid PRIMARY KEY, aggregate_type text, aggregate_id text,
                                         event_type text, payload jsonb, headers jsonb,
                                         created_at timestamptz)",
        )
        .await
        .unwrap();
    succeeded(&walbox(&db, &["init-slot"]).output().unwrap());
    let out = walbox(
        &db,
        &[
            "run",
            "--kafka-brokers",
            "127.0.0.1:1",
            "--backlog-max-bytes",
            "1000000",
        ],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.contains("walbox migrate"), "{stderr}");
}
