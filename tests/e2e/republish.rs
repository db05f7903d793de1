//! Every path that publishes reaches the configured broker: the scenario
//! the RabbitMQ and SQS modules run on their broker (Kafka's own heal and
//! resync tests are in `drift.rs` and `lost_slot.rs`). Before the
//! broker-neutral layer, a heal or a resync with `sink = "rabbitmq"` or
//! `"sqs"` built a Kafka producer: the rows went to Kafka, or nowhere, and
//! the slot streamed on past them.

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use walbox_test_harness::slot::{current_wal_lsn, wait_confirmed_at_least, write_wal_elsewhere};
use walbox_test_harness::wait::wait_for;

use crate::support::*;

const UNPUBLISH: &str = "ALTER PUBLICATION walbox_outbox DROP TABLE outbox_events";
const REPUBLISH: &str = "ALTER PUBLICATION walbox_outbox ADD TABLE outbox_events";

/// The events' numbers read from the broker so far, by how often.
async fn wait_each_at_least(
    what: &str,
    seen: &mut HashMap<usize, usize>,
    read: &mut impl FnMut() -> Vec<usize>,
    total: usize,
    times: usize,
) {
    wait_for(what, Duration::from_secs(120), || {
        for n in read() {
            *seen.entry(n).or_default() += 1;
        }
        let short = (0..total)
            .filter(|n| seen.get(n).copied().unwrap_or(0) < times)
            .count();
        async move {
            match short {
                0 => Ok(()),
                _ => Err(format!(
                    "{short} of {total} events seen fewer than {times} times"
                )),
            }
        }
    })
    .await;
}

/// `on_drift = "heal"`, then `walbox resync --since`, on the broker that
/// `command` configures (`walbox <subcommand>` with its sink flags and
/// environment): 100 events streamed, 100 written while the publication
/// did not cover the table (only the heal can carry them), 100 after the
/// fix; then the slot recreated by a resync, which republishes all 300.
/// `read` takes what the broker holds, read by the broker's own client.
pub(crate) async fn heal_then_resync(
    client: &tokio_postgres::Client,
    command: impl Fn(&[&str]) -> Command,
    mut read: impl FnMut() -> Vec<usize>,
) {
    let since: String = client
        .query_one("SELECT (now() - interval '1 hour')::text", &[])
        .await
        .unwrap()
        .get(0);
    let mut relay = spawn_logged(command(&[
        "run",
        "--on-drift",
        "heal",
        "--slot-recreate-margin-secs",
        "1",
    ]));
    insert_events(client, 0, 100, |k| 1 + k % 5, 7).await;
    let head = current_wal_lsn(client).await;
    wait_confirmed_at_least(client, "walbox", head, Duration::from_secs(60)).await;
    client.batch_execute(UNPUBLISH).await.unwrap();
    insert_events(client, 100, 200, |k| 1 + k % 5, 7).await;
    write_wal_elsewhere(client, "elsewhere", 1 << 20).await;
    wait_log(
        &relay,
        "waiting for the publication to cover the outbox table",
    )
    .await;
    client.batch_execute(REPUBLISH).await.unwrap();
    insert_events(client, 200, 300, |k| 1 + k % 5, 7).await;
    let mut seen = HashMap::new();
    wait_each_at_least("the healed stream", &mut seen, &mut read, 300, 1).await;
    let log = stop(&mut relay).await;
    assert!(log.contains("publication drift healed"), "{log}");
    assert!(!log.contains("connected to Kafka"), "{log}");

    let out = command(&["resync", "--since", &since]).output().unwrap();
    let stdout = succeeded(&out);
    assert!(
        stdout.contains("recreated; republished 300 events"),
        "{stdout}"
    );
    wait_each_at_least("the resync's copies", &mut seen, &mut read, 300, 2).await;
}
