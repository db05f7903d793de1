//! `outbox-poller`: the polling outbox relay that `scripts/bench` measures
//! walbox against, written the way the outbox articles describe it and tuned
//! fairly.
//!
//! Each batch is one transaction:
//!
//! ```sql
//! BEGIN;
//! SELECT … FROM outbox_poll WHERE published_at IS NULL
//!   ORDER BY seq LIMIT $batch FOR UPDATE SKIP LOCKED;
//! -- produce every row (acks=all, idempotent), then wait for all the acks
//! UPDATE outbox_poll SET published_at = now() WHERE id = ANY($ids);
//! COMMIT;
//! ```
//!
//! Fair tuning: prepared statements, one round of produce calls per batch with
//! all deliveries in flight at once (not one-by-one), a partial index on the
//! unpublished rows, and walbox's own producer settings (`acks=all`,
//! idempotence, lz4, `linger.ms=1`). Several pollers may run at once: `SKIP
//! LOCKED` keeps them off each other's rows (order across pollers is then lost,
//! which is one reason walbox does not work this way).
//!
//! The table it expects (created by `scripts/bench` from `outbox_events`):
//! walbox's outbox columns (their `seq` identity is the publishing order) and
//! `published_at timestamptz` (NULL until published), with an index
//! `(seq) WHERE published_at IS NULL`.
//!
//! On exit it prints one line, `events=N batches=N statements=N table_statements=N seconds=S`
//! (`statements` counts BEGIN and COMMIT too; `table_statements` only those on
//! the outbox table),
//! which the bench script parses. A failed delivery rolls the batch back and
//! exits 1, so nothing is marked published that was not acknowledged.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_postgres::NoTls;

/// A polling outbox relay (`SELECT … FOR UPDATE SKIP LOCKED`, publish, mark
/// published), for comparison with walbox in `scripts/bench`.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Postgres connection string (URL or `key=value` form).
    #[arg(long)]
    pg_url: String,
    /// Kafka bootstrap servers.
    #[arg(long)]
    brokers: String,
    /// The polled table (see the module docs for the columns it needs).
    #[arg(long, default_value = "outbox_poll")]
    table: String,
    /// Rows claimed, published and marked per transaction.
    #[arg(long, default_value_t = 500)]
    batch: i64,
    /// Sleep between polls that find nothing.
    #[arg(long, default_value_t = 1000)]
    poll_interval_ms: u64,
    /// Exit at the first poll that finds nothing (draining a backlog).
    #[arg(long)]
    until_empty: bool,
    /// Topic template; `{aggregate_type}` is replaced, as in walbox.
    #[arg(long, default_value = "outbox.event.{aggregate_type}")]
    topic_template: String,
}

#[derive(Default)]
struct Totals {
    events: u64,
    batches: u64,
    statements: u64,
    table_statements: u64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("outbox-poller: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> Result<(), String> {
    if args.batch < 1 {
        return Err("--batch must be at least 1".into());
    }
    let mut config = ClientConfig::new();
    for (key, value) in sink_kafka::contract_defaults() {
        config.set(key, value);
    }
    config.set("bootstrap.servers", &args.brokers);
    let producer: FutureProducer = config
        .create()
        .map_err(|e| format!("creating the producer: {e}"))?;

    let (mut client, connection) = tokio_postgres::connect(&args.pg_url, NoTls)
        .await
        .map_err(|e| format!("connecting to Postgres: {e}"))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("outbox-poller: connection: {e}");
        }
    });

    // Its server process, whose CPU the benchmark reads from /proc.
    let backend_pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .map_err(|e| format!("reading the backend's pid: {e}"))?
        .get(0);

    let table = &args.table;
    let claim = client
        .prepare(&format!(
            "SELECT id::text, aggregate_type, aggregate_id, event_type, payload::text, headers::text,
                    (extract(epoch FROM created_at) * 1000)::int8
               FROM {table} WHERE published_at IS NULL
              ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED"
        ))
        .await
        .map_err(|e| format!("preparing the claim query on {table}: {e}"))?;
    let mark = client
        .prepare(&format!(
            "UPDATE {table} SET published_at = now() WHERE id = ANY($1::text[]::uuid[])"
        ))
        .await
        .map_err(|e| format!("preparing the mark query on {table}: {e}"))?;

    let mut totals = Totals::default();
    let started = Instant::now();
    loop {
        let tx = client.transaction().await.map_err(|e| e.to_string())?;
        let rows = tx
            .query(&claim, &[&args.batch])
            .await
            .map_err(|e| format!("claim: {e}"))?;
        totals.statements += 2; // BEGIN, SELECT
        totals.table_statements += 1;
        if rows.is_empty() {
            tx.commit().await.map_err(|e| e.to_string())?;
            totals.statements += 1;
            if args.until_empty {
                break;
            }
            tokio::time::sleep(Duration::from_millis(args.poll_interval_ms)).await;
            continue;
        }

        let mut ids = Vec::with_capacity(rows.len());
        let mut deliveries = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: String = row.get(0);
            let aggregate_type: &str = row.get(1);
            let aggregate_id: &str = row.get(2);
            let event_type: &str = row.get(3);
            let payload: &str = row.get(4);
            let headers_json: &str = row.get(5);
            let timestamp_ms: i64 = row.get(6);
            let topic = args
                .topic_template
                .replace("{aggregate_type}", aggregate_type);
            let mut headers = OwnedHeaders::new()
                .insert(Header {
                    key: "id",
                    value: Some(id.as_str()),
                })
                .insert(Header {
                    key: "event_type",
                    value: Some(event_type),
                });
            headers = add_json_headers(headers, headers_json)?;
            let record = FutureRecord::to(&topic)
                .key(aggregate_id)
                .payload(payload)
                .headers(headers)
                .timestamp(timestamp_ms);
            let delivery = producer
                .send_result(record)
                .map_err(|(e, _)| format!("producing event {id}: {e}"))?;
            deliveries.push(delivery);
            ids.push(id);
        }
        for delivery in deliveries {
            match delivery.await {
                Ok(Ok(_)) => {}
                Ok(Err((e, _))) => return Err(format!("delivery failed, batch rolled back: {e}")),
                Err(_) => return Err("delivery cancelled, batch rolled back".into()),
            }
        }
        tx.execute(&mark, &[&ids])
            .await
            .map_err(|e| format!("mark published: {e}"))?;
        tx.commit().await.map_err(|e| format!("commit: {e}"))?;
        totals.statements += 2; // UPDATE, COMMIT
        totals.table_statements += 1;
        totals.events += ids.len() as u64;
        totals.batches += 1;
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "events={} batches={} statements={} table_statements={} seconds={seconds:.3} backend_pid={backend_pid}",
        totals.events, totals.batches, totals.statements, totals.table_statements
    );
    Ok(())
}

/// Adds each key of the row's `headers` JSON object as a Kafka header, as
/// walbox does (strings as is, other values as JSON text).
fn add_json_headers(mut headers: OwnedHeaders, json: &str) -> Result<OwnedHeaders, String> {
    if json == "{}" {
        return Ok(headers);
    }
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("headers column: {e}"))?;
    let serde_json::Value::Object(map) = value else {
        return Err("headers column is not a JSON object".into());
    };
    for (key, value) in map {
        let text = match value {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        };
        headers = headers.insert(Header {
            key: &key,
            value: Some(text.as_str()),
        });
    }
    Ok(headers)
}
