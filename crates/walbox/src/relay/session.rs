//! One replication session at a time: the select loop, the drain on
//! shutdown, and the state the handlers (`handlers.rs`) work on.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;

use pgoutput_decoder::{Decoder, PgTimestamp};
use sink_kafka::Record;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{
    Backoff, Deliveries, Destination, RelayConfig, ReplicationStream, RunError, Source, Token,
};
use crate::mapping::{ColumnIndexes, MapError};
use crate::metrics::Metrics;
use crate::progress::{Progress, EAGER_GAP};

/// How often the slot's retained WAL is sampled for the metrics.
const SLOT_SAMPLE_INTERVAL: Duration = Duration::from_secs(10);

/// The relay's state across sessions, and the current session's.
pub(super) struct Session<'a, D, R> {
    pub(super) config: &'a RelayConfig,
    destination: &'a D,
    reports: &'a mut R,
    pub(super) metrics: Arc<Metrics>,
    /// The one owner of what may be confirmed.
    pub(super) progress: Progress,
    /// Records waiting for room: the event just mapped, dead-letter copies.
    pub(super) outgoing: VecDeque<Record<Token>>,
    /// Outbox relations by OID (the root table; partitions publish as the
    /// root), resolved from this session's Relation messages.
    pub(super) outbox: HashMap<u32, Result<ColumnIndexes, MapError>>,
    /// The open transaction's commit time (from Begin).
    pub(super) commit_time: PgTimestamp,
    /// Topic names shared by the tokens of their events (`""` for a row
    /// that names none).
    pub(super) topics: HashMap<String, Arc<str>>,
}

/// Resolves when `shutdown` is (or turns) true; never if its sender is gone
/// without saying so.
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    if shutdown.wait_for(|stop| *stop).await.is_err() {
        std::future::pending::<()>().await;
    }
}

impl<'a, D: Destination, R: Deliveries> Session<'a, D, R> {
    pub(super) fn new(
        config: &'a RelayConfig,
        destination: &'a D,
        reports: &'a mut R,
        metrics: Arc<Metrics>,
    ) -> Self {
        Session {
            config,
            destination,
            reports,
            metrics,
            progress: Progress::new(config.status_interval, EAGER_GAP),
            outgoing: VecDeque::new(),
            outbox: HashMap::new(),
            commit_time: PgTimestamp::default(),
            topics: HashMap::new(),
        }
    }

    /// One session: start streaming, loop, and on the way out either drain
    /// (shutdown) or leave the rest to the next session (transient error).
    pub(super) async fn run<S: Source>(
        &mut self,
        source: &mut S,
        shutdown: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
    ) -> Result<(), RunError> {
        let (mut stream, start) = tokio::select! {
            biased;
            () = stopped(shutdown) => return Ok(()),
            started = source.start() => started?,
        };
        backoff.reset();
        self.metrics.set_streaming(true);
        self.progress.start_session(start);
        self.outgoing.clear();
        self.outbox.clear();
        tracing::info!(lsn = %start, "streaming from the slot");

        let result = self.stream(&mut stream, shutdown).await;
        match result {
            Ok(()) => {
                self.drain(&mut stream).await?;
                let update = self.progress.final_update(Instant::now());
                match stream.send_status(update).await {
                    Ok(()) => tracing::info!(lsn = %update.flush, "confirmed on shutdown"),
                    Err(e) => tracing::warn!(error = %e, "could not send the final status update"),
                }
                stream.close().await;
                Ok(())
            }
            Err(e) if e.is_transient() => Err(e),
            Err(e) => {
                // Confirm what is safely delivered before stopping.
                let _ = stream
                    .send_status(self.progress.final_update(Instant::now()))
                    .await;
                Err(e)
            }
        }
    }

    /// The select loop, until shutdown (`Ok`) or an error.
    async fn stream<S: ReplicationStream>(
        &mut self,
        stream: &mut S,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RunError> {
        let mut decoder = Decoder::new(1).expect("version 1 is supported");
        // Both timers live across iterations and are reset only when their
        // deadline moves. A fresh `sleep_until` per iteration registers with
        // the runtime's timer wheel every time, and from this thread that
        // wakes the driver thread: once per message, ~17% of walbox's CPU in
        // a backlog drain.
        let sample = tokio::time::sleep_until(tokio::time::Instant::now());
        tokio::pin!(sample);
        let status_due = tokio::time::sleep_until(self.progress.next_due());
        tokio::pin!(status_due);
        // One shutdown future for the whole session: a fresh one per
        // iteration would register and deregister a waiter (two mutex
        // round trips) per message.
        let stop = stopped(shutdown);
        tokio::pin!(stop);
        loop {
            self.update_gauges();
            let due = self.progress.next_due();
            if status_due.deadline() != due {
                status_due.as_mut().reset(due);
            }
            let waiting = self.outgoing.front().map(Record::size);
            tokio::select! {
                biased;
                report = self.reports.next() => {
                    let update = self.on_report(report.expect("the destination outlives the relay"))?;
                    send_status(stream, update).await?;
                }
                () = &mut stop => return Ok(()),
                () = &mut status_due => {
                    send_status(stream, self.progress.tick(Instant::now())).await?;
                }
                () = &mut sample => {
                    let next = sample.deadline() + SLOT_SAMPLE_INTERVAL;
                    sample.as_mut().reset(next);
                    if let Some(bytes) = stream.retained_wal_bytes().await {
                        self.metrics.retained_wal_bytes.set(bytes);
                    }
                }
                permit = self.destination.reserve(waiting.unwrap_or(0)), if waiting.is_some() => {
                    self.send_front(permit).await;
                }
                // Read only while nothing waits for room: memory stays within
                // the in-flight bounds plus one record.
                message = stream.next(), if waiting.is_none() => {
                    let update = self.on_message(&mut decoder, message?)?;
                    send_status(stream, update).await?;
                    self.send_while_room().await;
                }
            }
        }
    }

    /// Sends waiting records while there is room right now: the common case
    /// costs no extra turn of the loop. Whatever must wait for room is left
    /// to the loop's `reserve` branch.
    async fn send_while_room(&mut self) {
        while let Some(size) = self.outgoing.front().map(Record::size) {
            let Some(permit) = self.destination.reserve(size).now_or_never() else {
                return;
            };
            self.send_front(permit).await;
        }
    }

    /// Sends the first waiting record with the room reserved for it.
    async fn send_front(&mut self, permit: D::Permit) {
        let record = self.outgoing.pop_front().expect("a record is waiting");
        self.destination.send(permit, record).await;
    }

    /// Waits (up to the shutdown timeout) until every event of this session
    /// that was sent, or waits to be sent, has its report.
    async fn drain<S: ReplicationStream>(&mut self, stream: &mut S) -> Result<(), RunError> {
        let deadline = tokio::time::Instant::now() + self.config.shutdown_timeout;
        while self.progress.unacked_events() > 0 {
            let waiting = self.outgoing.front().map(Record::size);
            tokio::select! {
                biased;
                report = self.reports.next() => {
                    let update = self.on_report(report.expect("the destination outlives the relay"))?;
                    // Best effort: the final update follows anyway.
                    if let Some(update) = update {
                        let _ = stream.send_status(update).await;
                    }
                }
                permit = self.destination.reserve(waiting.unwrap_or(0)), if waiting.is_some() => {
                    self.send_front(permit).await;
                }
                () = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(
                        unacked = self.progress.unacked_events(),
                        "shutdown timeout: leaving events unconfirmed (they are resent after restart)"
                    );
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    fn update_gauges(&self) {
        let m = &self.metrics;
        m.in_flight_events.set(self.destination.in_flight() as i64);
        m.in_flight_bytes
            .set(self.destination.in_flight_bytes() as i64);
        m.received_lsn
            .set(self.progress.received_lsn().as_u64() as i64);
        m.confirmed_lsn
            .set(self.progress.confirmable().as_u64() as i64);
    }
}

async fn send_status<S: ReplicationStream>(
    stream: &mut S,
    update: Option<pgoutput_decoder::StandbyStatusUpdate>,
) -> Result<(), RunError> {
    match update {
        Some(update) => stream.send_status(update).await,
        None => Ok(()),
    }
}
