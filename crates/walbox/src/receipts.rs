//! Delivery receipts (`receipts = true`): where the broker stored each
//! event, written to `walbox.receipts` (migration 0005) so an application
//! can wait until its event is on Kafka with `walbox.await_delivery`.
//!
//! - **Never in the slot's way.** The relay hands each acknowledged event
//!   to a [`Recorder`] without waiting (a bounded queue); a full queue or a
//!   failed write loses receipts (counted, warned), never holds an event.
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

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

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
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
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
}

impl Recorder {
    /// A recorder and the queue its writer reads (for [`run`], or a test).
    pub fn new(metrics: Arc<Metrics>) -> (Recorder, mpsc::Receiver<Receipt>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        (Recorder { tx, metrics }, rx)
    }

    /// Queues a receipt; drops it (counted) when the writer is behind.
    pub fn record(&self, receipt: Receipt) {
        if self.tx.try_send(receipt).is_err() {
            self.metrics.receipts_dropped.inc();
        }
    }
}

/// What to do when [`installed`] says no.
pub const NOT_INSTALLED: &str = "receipts = true needs walbox.receipts and walbox.receipt_generation (run `walbox migrate`), and walbox's role may INSERT and DELETE receipts and UPDATE the generation (docs/configuration.md, \"Delivery receipts\")";

/// Whether `walbox migrate` installed the receipts and walbox may write
/// them (checked at start, to fail fast).
pub async fn installed(client: &Client) -> Result<bool, Error> {
    let row = client
        .query_one(
            // CASE, not AND: has_table_privilege fails on a missing table.
            "SELECT CASE WHEN to_regclass('walbox.receipts') IS NULL
                           OR to_regclass('walbox.receipt_generation') IS NULL THEN false
                         ELSE has_table_privilege('walbox.receipts', 'INSERT')
                          AND has_table_privilege('walbox.receipts', 'DELETE')
                          AND has_table_privilege('walbox.receipt_generation', 'UPDATE') END",
            &[],
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
    mut rx: mpsc::Receiver<Receipt>,
    pg: PgConfig,
    keep: Duration,
    metrics: Arc<Metrics>,
) {
    let mut backoff = Duration::from_millis(200);
    let mut warned = false;
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        if batch.is_empty() && rx.recv_many(&mut batch, BATCH).await == 0 {
            return;
        }
        let mut writer = match Writer::connect(&pg).await {
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
    async fn connect(pg: &PgConfig) -> Result<Writer, Error> {
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
            let ids: Vec<&str> = receipts.iter().map(|r| &*r.event_id).collect();
            let topics: Vec<&str> = receipts.iter().map(|r| &*r.topic).collect();
            let partitions: Vec<i32> = receipts.iter().map(|r| r.partition).collect();
            let offsets: Vec<i64> = receipts.iter().map(|r| r.offset).collect();
            let acked: Vec<SystemTime> = receipts.iter().map(|r| r.acked_at).collect();
            let dead: Vec<bool> = receipts.iter().map(|r| r.dead_lettered).collect();
            // A re-send after a reconnect adds a second receipt;
            // await_delivery returns the earliest (no unique index: see
            // migration 0005).
            tx.execute(
                "INSERT INTO walbox.receipts (event_id, topic, kafka_partition, kafka_offset, acked_at, dead_lettered)
                 SELECT * FROM unnest($1::text[], $2::text[], $3::int4[], $4::int8[], $5::timestamptz[], $6::bool[])",
                &[&ids, &topics, &partitions, &offsets, &acked, &dead],
            )
            .await
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
            partition: 0,
            offset: 1,
            acked_at: SystemTime::UNIX_EPOCH,
            dead_lettered: false,
        };
        for _ in 0..QUEUE + 3 {
            recorder.record(receipt.clone());
        }
        assert_eq!(metrics.receipts_dropped.get(), 3);
        assert_eq!(drain(&mut rx), QUEUE as u64);
    }
}
