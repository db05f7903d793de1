//! Delivery receipts (`receipts = true`): where the broker stored each
//! event, in its own terms (a Kafka partition and offset, a RabbitMQ
//! exchange and routing key, an SQS message id and sequence number),
//! written to `walbox.receipts` (migrations 0005 and 0006) so an
//! application can wait until its event is on the broker with
//! `walbox.await_delivery`.
//!
//! - **Never in the events' way.** The relay hands each acknowledged event
//!   to a [`Recorder`] without waiting (a bounded queue); a full queue or a
//!   failed write loses receipts (counted, warned), never holds an event.
//! - **Not lost to a crash.** The slot is confirmed past an event only once
//!   its receipt is settled: written, or given up and counted
//!   ([`Recorder::settled`]). A kill -9 then loses no receipt of a confirmed
//!   event: what was not settled is sent again by the next start, and its
//!   receipt written then. Only the confirmed position waits, not events.
//! - **Batched**, on a connection of its own: up to [`BATCH`] receipts per
//!   statement, as they come.
//! - **Waking the waiters** without a polling loop: walbox holds the
//!   advisory lock of the current receipt *generation* (class
//!   [`LOCK_CLASS`]); each batch takes the next generation's lock, commits
//!   its receipts with the generation moved on, then lets the old lock go,
//!   which wakes every `await_delivery` blocked on it to look again. A
//!   `NOTIFY walbox_receipts` follows, for clients that `LISTEN`.
//! - **Pruned** after the retention setting (1 hour without one).
//! - One writer per database: receipts with `shards > 1` are refused by
//!   the configuration (each shard would need its own generation).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use sink_core::Delivered;
use slot_manager::{connect_control, Error, PgConfig};
use tokio::sync::mpsc;
use tokio_postgres::Client;

use crate::metrics::Metrics;

/// The advisory lock class of receipt generations (`walbox_r`), as
/// `walbox.await_delivery` has it.
pub const LOCK_CLASS: i32 = 2_002_873_970;
/// Receipts written per statement, at most.
pub const BATCH: usize = 10_000;
/// Receipts waiting to be written, at most; more are dropped (counted).
const QUEUE: usize = 100_000;
/// How often old receipts are deleted.
const PRUNE_EVERY: Duration = Duration::from_secs(60);
/// Receipts deleted per statement when pruning.
const PRUNE_BATCH: i64 = 10_000;
/// How long the receipts connection stays open without receipts.
const IDLE_CLOSE: Duration = Duration::from_secs(30);
/// How long taking a generation lock may wait (another instance's writer
/// holding it until its connection goes idle): then the batch is lost and
/// the writer connects again.
const LOCK_TIMEOUT: &str = "10s";

/// Where an event landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Receipt {
    /// The event id.
    pub event_id: Box<str>,
    /// Its topic (the dead-letter topic for a dead-lettered event).
    pub topic: Arc<str>,
    /// Where the broker stored it.
    pub at: Delivered,
    /// When walbox received the acknowledgement.
    pub acked_at: SystemTime,
    /// Published to the dead-letter topic instead of its own.
    pub dead_lettered: bool,
}

/// The relay's side: hands receipts to the writer without waiting.
#[derive(Clone, Debug)]
pub struct Recorder {
    tx: mpsc::Sender<Receipt>,
    metrics: Arc<Metrics>,
    counts: Arc<Counts>,
}

/// Receipts handed over, and those settled: written, or lost and counted.
#[derive(Debug, Default)]
struct Counts {
    recorded: AtomicU64,
    settled: AtomicU64,
}

impl Counts {
    fn settle(&self, n: u64) {
        self.settled.fetch_add(n, Ordering::Release);
    }
}

/// What the writer reads: the receipts, and where it says they settled.
#[derive(Debug)]
pub struct Queue {
    rx: mpsc::Receiver<Receipt>,
    counts: Arc<Counts>,
}

impl Queue {
    /// The next receipt, taken and settled as a writer would once it wrote
    /// it; `None` when the recorders are gone and nothing waits.
    pub async fn recv(&mut self) -> Option<Receipt> {
        let receipt = self.rx.recv().await;
        self.counts.settle(u64::from(receipt.is_some()));
        receipt
    }
}

impl Recorder {
    /// A recorder and the queue its writer reads (for [`run`], or a test).
    pub fn new(metrics: Arc<Metrics>) -> (Recorder, Queue) {
        let (tx, rx) = mpsc::channel(QUEUE);
        let counts = Arc::new(Counts::default());
        let queue = Queue {
            rx,
            counts: Arc::clone(&counts),
        };
        (
            Recorder {
                tx,
                metrics,
                counts,
            },
            queue,
        )
    }

    /// Queues a receipt; drops it (counted) when the writer is behind.
    pub fn record(&self, receipt: Receipt) {
        self.counts.recorded.fetch_add(1, Ordering::Relaxed);
        if self.tx.try_send(receipt).is_err() {
            self.metrics.receipts_dropped.inc();
            self.counts.settle(1);
        }
    }

    /// Receipts recorded so far.
    pub fn recorded(&self) -> u64 {
        self.counts.recorded.load(Ordering::Relaxed)
    }

    /// Receipts settled so far: written, or lost and counted. Once it
    /// reaches what [`Recorder::recorded`] said, every receipt recorded
    /// before is settled.
    pub fn settled(&self) -> u64 {
        self.counts.settled.load(Ordering::Acquire)
    }

    /// Waits until every receipt recorded so far is settled, or `deadline`.
    pub async fn settle(&self, deadline: tokio::time::Instant) -> bool {
        let target = self.recorded();
        while self.settled() < target {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }
}

/// What to do when [`installed`] says no.
pub const NOT_INSTALLED: &str = "receipts = true needs walbox.receipts and walbox.receipt_generation (run `walbox migrate`; with RabbitMQ or SQS, migration 0006 too), and walbox's role may INSERT and DELETE receipts and UPDATE the generation (docs/configuration.md, \"Delivery receipts\")";

/// Which columns receipts are written to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Columns {
    /// Kafka's alone (migration 0005): what a Kafka walbox writes, so a
    /// database not migrated past 0005 keeps working.
    Kafka,
    /// Every broker's (migration 0006).
    EveryBroker,
}

impl Columns {
    /// The columns a walbox publishing to `broker` writes.
    pub fn for_broker(broker: &str) -> Columns {
        match broker {
            "kafka" => Columns::Kafka,
            _ => Columns::EveryBroker,
        }
    }
}

/// Whether `walbox migrate` installed the receipts (with `columns`) and
/// walbox may write them (checked at start, to fail fast).
pub async fn installed(client: &Client, columns: Columns) -> Result<bool, Error> {
    let row = client
        .query_one(
            // CASE, not AND: has_table_privilege fails on a missing table.
            "SELECT CASE WHEN to_regclass('walbox.receipts') IS NULL
                           OR to_regclass('walbox.receipt_generation') IS NULL THEN false
                         WHEN $1 AND NOT EXISTS (
                             SELECT 1 FROM pg_attribute
                              WHERE attrelid = to_regclass('walbox.receipts')
                                AND attname = 'broker' AND NOT attisdropped) THEN false
                         ELSE has_table_privilege('walbox.receipts', 'INSERT')
                          AND has_table_privilege('walbox.receipts', 'DELETE')
                          AND has_table_privilege('walbox.receipt_generation', 'UPDATE') END",
            &[&(columns == Columns::EveryBroker)],
        )
        .await
        .map_err(Error::sql("look for walbox.receipts"))?;
    Ok(row.get::<_, Option<bool>>(0) == Some(true))
}

/// Writes receipts until the queue closes (the process ends). It connects
/// when the first receipt comes (a standby instance, which delivers
/// nothing, holds no connection and no generation lock), takes the
/// generation lock, writes batches as they come, prunes, and lets the
/// connection go after [`IDLE_CLOSE`] without receipts (an instance that
/// lost the slot to another stops holding a lock the other needs). After a
/// failure it counts what it lost and connects again.
pub async fn run(
    queue: Queue,
    pg: PgConfig,
    columns: Columns,
    keep: Duration,
    metrics: Arc<Metrics>,
) {
    let Queue { mut rx, counts } = queue;
    let mut backoff = Duration::from_millis(200);
    let mut warned = false;
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        if batch.is_empty() && rx.recv_many(&mut batch, BATCH).await == 0 {
            return;
        }
        let mut writer = match Writer::connect(&pg, columns).await {
            Ok(w) => {
                backoff = Duration::from_millis(200);
                w
            }
            Err(e) => {
                if !warned {
                    tracing::warn!(error = %e, "receipts cannot be written; events flow on, their receipts are lost until this recovers (walbox_receipts_failed_total)");
                    warned = true;
                }
                // What arrives meanwhile is lost: receipts never wait.
                let lost = batch.len() as u64 + drain(&mut rx);
                batch.clear();
                metrics.receipts_failed.inc_by(lost);
                counts.settle(lost);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        let mut pruned: Option<Instant> = None;
        let mut last_receipt = Instant::now();
        loop {
            if !batch.is_empty() {
                let n = batch.len() as u64;
                if let Err(e) = writer.write(&batch).await {
                    metrics.receipts_failed.inc_by(n);
                    counts.settle(n);
                    if !warned {
                        tracing::warn!(error = %e, receipts = n, "writing receipts failed; events flow on, their receipts are lost until this recovers (walbox_receipts_failed_total)");
                        warned = true;
                    }
                    batch.clear();
                    break;
                }
                if std::mem::take(&mut warned) {
                    tracing::info!("receipts are written again");
                }
                metrics.receipts_written.inc_by(n);
                counts.settle(n);
                batch.clear();
                last_receipt = Instant::now();
            }
            if pruned.is_none_or(|p| p.elapsed() >= PRUNE_EVERY) {
                pruned = Some(Instant::now());
                if let Err(e) = writer.prune(keep).await {
                    tracing::warn!(error = %e, "deleting old receipts failed; tried again in a minute");
                }
            }
            if last_receipt.elapsed() >= IDLE_CLOSE {
                break;
            }
            let wake = PRUNE_EVERY.min(IDLE_CLOSE.saturating_sub(last_receipt.elapsed()));
            let got = tokio::select! {
                n = rx.recv_many(&mut batch, BATCH) => n,
                () = tokio::time::sleep(wake) => usize::MAX,
            };
            if got == 0 {
                // The queue closed and everything in it was written.
                return;
            }
        }
    }
}

/// Takes what waits in the queue; returns how many.
fn drain(rx: &mut mpsc::Receiver<Receipt>) -> u64 {
    let mut n = 0;
    while rx.try_recv().is_ok() {
        n += 1;
    }
    n
}

/// The receipts connection, holding the current generation's lock.
struct Writer {
    client: Client,
    columns: Columns,
    generation: i64,
    /// Whether this connection holds `generation`'s lock (not yet, right
    /// after connecting: another writer's, or nobody's).
    holding: bool,
}

/// The lock key of generation `g` (the function's `g % 2147483647`).
fn key(generation: i64) -> i32 {
    (generation % i64::from(i32::MAX)) as i32
}

impl Writer {
    /// Connects and takes the next generation: its lock first, then the
    /// generation moved to it, so a waiter that reads it blocks on it.
    async fn connect(pg: &PgConfig, columns: Columns) -> Result<Writer, Error> {
        let client = connect_control(pg).await?;
        client
            .batch_execute(&format!(
                "SET application_name = 'walbox receipts'; SET lock_timeout = '{LOCK_TIMEOUT}'"
            ))
            .await
            .map_err(Error::sql("set up the receipts connection"))?;
        let current: i64 = client
            .query_one("SELECT generation FROM walbox.receipt_generation", &[])
            .await
            .map_err(Error::sql("read the receipt generation"))?
            .get(0);
        let mut writer = Writer {
            client,
            columns,
            generation: current,
            holding: false,
        };
        writer.advance(None).await?;
        Ok(writer)
    }

    /// Takes the next generation's lock, commits `insert` (receipts) with
    /// the generation moved on, then lets the current one go: every waiter
    /// blocked on it wakes and finds what was committed.
    async fn advance(&mut self, insert: Option<&[Receipt]>) -> Result<(), Error> {
        let next = self.generation + 1;
        self.client
            .execute(
                "SELECT pg_advisory_lock($1, $2)",
                &[&LOCK_CLASS, &key(next)],
            )
            .await
            .map_err(Error::sql("lock the next receipt generation"))?;
        let tx = self
            .client
            .transaction()
            .await
            .map_err(Error::sql("begin writing receipts"))?;
        if let Some(receipts) = insert {
            let rows = Rows::of(receipts);
            // A re-send after a reconnect adds a second receipt;
            // await_delivery returns the earliest (no unique index: see
            // migration 0005).
            let kafka: [&(dyn tokio_postgres::types::ToSql + Sync); 6] = [
                &rows.ids,
                &rows.topics,
                &rows.partitions,
                &rows.offsets,
                &rows.acked,
                &rows.dead,
            ];
            let every: [&(dyn tokio_postgres::types::ToSql + Sync); 8] = [
                &rows.brokers,
                &rows.exchanges,
                &rows.routing_keys,
                &rows.message_ids,
                &rows.sequence_numbers,
                &rows.nats_streams,
                &rows.nats_sequences,
                &rows.http_statuses,
            ];
            match self.columns {
                Columns::Kafka => tx.execute(
                    "INSERT INTO walbox.receipts (event_id, topic, kafka_partition, kafka_offset, acked_at, dead_lettered)
                     SELECT * FROM unnest($1::text[], $2::text[], $3::int4[], $4::int8[], $5::timestamptz[], $6::bool[])",
                    &kafka,
                ).await,
                Columns::EveryBroker => tx.execute(
                    "INSERT INTO walbox.receipts (event_id, topic, kafka_partition, kafka_offset, acked_at, dead_lettered,
                                                  broker, amqp_exchange, amqp_routing_key, sqs_message_id, sqs_sequence_number,
                                                  nats_stream, nats_sequence, http_status)
                     SELECT * FROM unnest($1::text[], $2::text[], $3::int4[], $4::int8[], $5::timestamptz[], $6::bool[],
                                          $7::text[], $8::text[], $9::text[], $10::text[], $11::text[],
                                          $12::text[], $13::int8[], $14::int4[])",
                    &[&kafka[..], &every[..]].concat(),
                ).await,
            }
            .map_err(Error::sql("write receipts"))?;
        }
        tx.execute(
            "UPDATE walbox.receipt_generation SET generation = $1",
            &[&next],
        )
        .await
        .map_err(Error::sql("move the receipt generation on"))?;
        tx.batch_execute("NOTIFY walbox_receipts")
            .await
            .map_err(Error::sql("notify receipt listeners"))?;
        tx.commit().await.map_err(Error::sql("commit receipts"))?;
        let previous = std::mem::replace(&mut self.generation, next);
        if std::mem::replace(&mut self.holding, true) {
            self.client
                .execute(
                    "SELECT pg_advisory_unlock($1, $2)",
                    &[&LOCK_CLASS, &key(previous)],
                )
                .await
                .map_err(Error::sql("let the last receipt generation go"))?;
        }
        Ok(())
    }

    async fn write(&mut self, receipts: &[Receipt]) -> Result<(), Error> {
        self.advance(Some(receipts)).await
    }

    /// Deletes receipts older than `keep`, a batch at a time.
    async fn prune(&self, keep: Duration) -> Result<u64, Error> {
        let keep_ms = keep.as_millis() as i64;
        let mut total = 0;
        loop {
            let n = self
                .client
                .execute(
                    "DELETE FROM walbox.receipts WHERE ctid = ANY (ARRAY(
                       SELECT ctid FROM walbox.receipts
                        WHERE acked_at < now() - $1 * interval '1 millisecond'
                        LIMIT $2))",
                    &[&(keep_ms as f64), &PRUNE_BATCH],
                )
                .await
                .map_err(Error::sql("delete old receipts"))?;
            total += n;
            if n < PRUNE_BATCH as u64 {
                return Ok(total);
            }
        }
    }
}

/// Receipts as the columns' arrays.
#[derive(Default)]
struct Rows<'a> {
    ids: Vec<&'a str>,
    topics: Vec<&'a str>,
    acked: Vec<SystemTime>,
    dead: Vec<bool>,
    partitions: Vec<Option<i32>>,
    offsets: Vec<Option<i64>>,
    brokers: Vec<&'static str>,
    exchanges: Vec<Option<&'a str>>,
    routing_keys: Vec<Option<&'a str>>,
    message_ids: Vec<Option<&'a str>>,
    sequence_numbers: Vec<Option<&'a str>>,
    nats_streams: Vec<Option<&'a str>>,
    nats_sequences: Vec<Option<i64>>,
    http_statuses: Vec<Option<i32>>,
}

/// Where one receipt's event landed, as its columns: the broker's own
/// set, the others' NULL.
#[derive(Default)]
struct Landed<'a> {
    broker: &'static str,
    partition: Option<i32>,
    offset: Option<i64>,
    exchange: Option<&'a str>,
    routing_key: Option<&'a str>,
    message_id: Option<&'a str>,
    sequence_number: Option<&'a str>,
    nats_stream: Option<&'a str>,
    nats_sequence: Option<i64>,
    http_status: Option<i32>,
}

impl<'a> Landed<'a> {
    fn of(at: &'a Delivered) -> Landed<'a> {
        match at {
            Delivered::Kafka { partition, offset } => Landed {
                broker: "kafka",
                partition: Some(*partition),
                offset: Some(*offset),
                ..Landed::default()
            },
            Delivered::Amqp {
                exchange,
                routing_key,
            } => Landed {
                broker: "rabbitmq",
                exchange: Some(exchange),
                routing_key: Some(routing_key),
                ..Landed::default()
            },
            Delivered::Sqs {
                message_id,
                sequence_number,
            } => Landed {
                broker: "sqs",
                message_id: Some(message_id),
                sequence_number: sequence_number.as_deref(),
                ..Landed::default()
            },
            Delivered::Nats {
                stream, sequence, ..
            } => Landed {
                broker: "nats",
                nats_stream: Some(stream),
                nats_sequence: i64::try_from(*sequence).ok(),
                ..Landed::default()
            },
            Delivered::Http { status } => Landed {
                broker: "webhook",
                http_status: Some(i32::from(*status)),
                ..Landed::default()
            },
            _ => Landed {
                broker: "other",
                ..Landed::default()
            },
        }
    }
}

impl<'a> Rows<'a> {
    fn of(receipts: &'a [Receipt]) -> Rows<'a> {
        let mut rows = Rows::default();
        for r in receipts {
            let at = Landed::of(&r.at);
            rows.ids.push(&r.event_id);
            rows.topics.push(&r.topic);
            rows.acked.push(r.acked_at);
            rows.dead.push(r.dead_lettered);
            rows.partitions.push(at.partition);
            rows.offsets.push(at.offset);
            rows.brokers.push(at.broker);
            rows.exchanges.push(at.exchange);
            rows.routing_keys.push(at.routing_key);
            rows.message_ids.push(at.message_id);
            rows.sequence_numbers.push(at.sequence_number);
            rows.nats_streams.push(at.nats_stream);
            rows.nats_sequences.push(at.nats_sequence);
            rows.http_statuses.push(at.http_status);
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_keys_match_the_functions_and_wrap_inside_int4() {
        assert_eq!(key(0), 0);
        assert_eq!(key(7), 7);
        assert_eq!(key(i64::from(i32::MAX)), 0);
        assert_eq!(key(i64::from(i32::MAX) + 5), 5);
    }

    #[test]
    fn a_full_queue_drops_receipts_and_counts_them() {
        let metrics = Metrics::new();
        let (recorder, mut rx) = Recorder::new(Arc::clone(&metrics));
        let receipt = Receipt {
            event_id: "e".into(),
            topic: Arc::from("t"),
            at: Delivered::Kafka {
                partition: 0,
                offset: 1,
            },
            acked_at: SystemTime::UNIX_EPOCH,
            dead_lettered: false,
        };
        for _ in 0..QUEUE + 3 {
            recorder.record(receipt.clone());
        }
        assert_eq!(metrics.receipts_dropped.get(), 3);
        // The dropped ones are settled (lost, counted); the queued are not.
        assert_eq!(
            (recorder.recorded(), recorder.settled()),
            (QUEUE as u64 + 3, 3)
        );
        assert_eq!(drain(&mut rx.rx), QUEUE as u64);
    }
}
