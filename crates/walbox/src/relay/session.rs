//! One replication session at a time: the select loop and its handlers.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use pgoutput_decoder::{Decoder, LogicalMessage, Lsn, PgTimestamp, ReplicationMessage};
use sink_kafka::{Record, Report};
use tokio::sync::watch;
use tokio::time::Instant;

use super::{
    Backoff, Deliveries, Destination, RelayConfig, ReplicationStream, RunError, Source, Token,
};
use crate::dead_letter::{failure_kind, DeadLetterKind, Origin};
use crate::mapping::{ColumnIndexes, MapError};
use crate::metrics::{KindLabels, Metrics, TopicLabel};
use crate::progress::{Ack, Progress, EAGER_GAP};

/// How often the slot's retained WAL is sampled for the metrics.
const SLOT_SAMPLE_INTERVAL: Duration = Duration::from_secs(10);

/// The relay's state across sessions, and the current session's.
pub(super) struct Session<'a, D, R> {
    config: &'a RelayConfig,
    destination: &'a D,
    reports: &'a mut R,
    metrics: Arc<Metrics>,
    /// The one owner of what may be confirmed.
    progress: Progress,
    /// Records waiting for room: the event just mapped, dead-letter copies.
    outgoing: VecDeque<Record<Token>>,
    /// Outbox relations by OID (the root table; partitions publish as the
    /// root), resolved from this session's Relation messages.
    outbox: HashMap<u32, Result<ColumnIndexes, MapError>>,
    /// The open transaction's commit time (from Begin).
    commit_time: PgTimestamp,
    /// Topic names shared by the tokens of their events.
    topics: HashMap<String, Arc<str>>,
    no_topic: Arc<str>,
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
            no_topic: Arc::from(""),
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
                () = stopped(shutdown) => return Ok(()),
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
                    let record = self.outgoing.pop_front().expect("a record is waiting");
                    self.destination.send(permit, record).await;
                }
                // Read only while nothing waits for room: memory stays within
                // the in-flight bounds plus one record.
                message = stream.next(), if waiting.is_none() => {
                    let update = self.on_message(&mut decoder, message?)?;
                    send_status(stream, update).await?;
                }
            }
        }
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
                    let record = self.outgoing.pop_front().expect("a record is waiting");
                    self.destination.send(permit, record).await;
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

    /// A delivery report: ack the event, dead-letter it, or stop.
    fn on_report(
        &mut self,
        report: Report<Token>,
    ) -> Result<Option<pgoutput_decoder::StandbyStatusUpdate>, RunError> {
        let Report {
            token,
            result,
            returned,
        } = report;
        match result {
            Ok(_) => {
                let update = match self.progress.ack(token.event, Instant::now())? {
                    Ack::Current(update) => update,
                    Ack::Stale => return Ok(None),
                };
                match token.dead_letter {
                    Some(kind) => {
                        self.metrics
                            .dead_lettered
                            .get_or_create(&KindLabels {
                                topic: token.topic.to_string(),
                                kind: kind.as_str(),
                            })
                            .inc();
                    }
                    None => {
                        self.metrics
                            .published
                            .get_or_create(&TopicLabel {
                                topic: token.topic.to_string(),
                            })
                            .inc();
                        let micros = PgTimestamp::now().as_unix_micros()
                            - token.commit_time.as_unix_micros();
                        self.metrics
                            .commit_to_ack
                            .observe(micros.max(0) as f64 / 1e6);
                    }
                }
                Ok(update)
            }
            Err(error) => {
                if !self.progress.is_current(token.event) {
                    // Its transaction is re-sent by the new session.
                    tracing::debug!(%error, "a report of an earlier session failed; ignored");
                    return Ok(None);
                }
                if token.dead_letter.is_some() {
                    tracing::error!(%error, lsn = %token.lsn, "the dead-letter copy failed");
                    return Err(RunError::DeadLetter(error));
                }
                let copy = Token {
                    dead_letter: Some(DeadLetterKind::Refused),
                    ..token.clone()
                };
                match self
                    .config
                    .dead_letters
                    .refused(&error, returned, token.lsn, copy)
                {
                    Some(record) => {
                        tracing::warn!(%error, topic = %token.topic, lsn = %token.lsn, dead_letter_topic = %record.topic, "broker refused an event; dead-lettering it");
                        self.outgoing.push_back(record);
                        Ok(None)
                    }
                    None => {
                        self.metrics
                            .failed
                            .get_or_create(&KindLabels {
                                topic: token.topic.to_string(),
                                kind: failure_kind(error.kind),
                            })
                            .inc();
                        tracing::error!(%error, topic = %token.topic, lsn = %token.lsn, "delivery failed");
                        Err(RunError::Delivery(error))
                    }
                }
            }
        }
    }

    /// Handles one frame; returns the status update due, if any.
    fn on_message(
        &mut self,
        decoder: &mut Decoder,
        message: ReplicationMessage,
    ) -> Result<Option<pgoutput_decoder::StandbyStatusUpdate>, RunError> {
        let xlog = match message {
            ReplicationMessage::PrimaryKeepalive(k) => {
                return Ok(self.progress.keepalive(
                    k.wal_end(),
                    k.reply_requested(),
                    Instant::now(),
                ))
            }
            ReplicationMessage::XLogData(x) => x,
            _ => return Ok(None),
        };
        self.progress.received(xlog.wal_end());
        let lsn = xlog.wal_start();
        match decoder.decode(xlog.into_data())? {
            LogicalMessage::Begin(b) => {
                self.progress.begin(b.final_lsn())?;
                self.commit_time = b.commit_time();
            }
            LogicalMessage::Commit(c) => {
                return Ok(self
                    .progress
                    .commit(c.commit_lsn(), c.end_lsn(), Instant::now())?)
            }
            LogicalMessage::Relation(r) => {
                let table = &self.config.table;
                if r.namespace() == table.schema() && r.name() == table.name() {
                    self.outbox.insert(r.oid(), self.config.mapping.resolve(&r));
                }
            }
            LogicalMessage::Insert(insert) => {
                let Some(columns) = self.outbox.get(&insert.relation_oid()) else {
                    return Ok(None); // another table (publication changed by hand)
                };
                let columns = columns.clone()?;
                self.on_insert(&columns, insert.tuple(), lsn)?;
            }
            // Only INSERTs are events; the app may delete rows freely.
            LogicalMessage::Update(_)
            | LogicalMessage::Delete(_)
            | LogicalMessage::Truncate(_)
            | LogicalMessage::Type(_)
            | LogicalMessage::Origin(_)
            | LogicalMessage::Message(_) => {}
            other => return Err(RunError::Unexpected(other.tag() as char)),
        }
        Ok(None)
    }

    /// Maps an inserted row and queues its record (or its dead-letter copy).
    fn on_insert(
        &mut self,
        columns: &ColumnIndexes,
        tuple: &pgoutput_decoder::TupleData,
        lsn: Lsn,
    ) -> Result<(), RunError> {
        match self.config.mapping.map(columns, tuple) {
            Ok(event) => {
                tracing::debug!(event_id = %event.event_id, aggregate_id = %event.aggregate_id, %lsn, topic = %event.topic, "event");
                let token = self.token(&event.topic, lsn, None)?;
                self.outgoing.push_back(Record {
                    topic: event.topic,
                    key: Some(event.key),
                    value: event.value,
                    headers: event.headers,
                    timestamp_ms: event.timestamp_ms,
                    token,
                });
            }
            Err(e) => {
                let topic = self.config.mapping.topic_of(columns, tuple);
                let event_id = self.config.mapping.event_id_of(columns, tuple);
                let token = self.token(
                    topic.as_deref().unwrap_or(""),
                    lsn,
                    Some(DeadLetterKind::Unmappable),
                )?;
                let origin = Origin {
                    topic: topic.as_deref(),
                    lsn,
                    event_id: event_id.as_deref(),
                };
                let payload = tuple.value_bytes(columns.payload_index());
                match self
                    .config
                    .dead_letters
                    .unmappable(&e, payload, origin, token)
                {
                    Some(record) => {
                        tracing::warn!(error = %e, %lsn, dead_letter_topic = %record.topic, "unmappable row sent to the dead-letter topic");
                        self.outgoing.push_back(record);
                    }
                    None => {
                        tracing::error!(error = %e, %lsn, "cannot map an outbox row");
                        return Err(RunError::Map(e));
                    }
                }
            }
        }
        Ok(())
    }

    /// The token for an event of the open transaction meant for `topic`.
    fn token(
        &mut self,
        topic: &str,
        lsn: Lsn,
        dead_letter: Option<DeadLetterKind>,
    ) -> Result<Token, RunError> {
        let topic = if topic.is_empty() {
            Arc::clone(&self.no_topic)
        } else if let Some(t) = self.topics.get(topic) {
            Arc::clone(t)
        } else {
            let t: Arc<str> = Arc::from(topic);
            self.topics.insert(topic.to_owned(), Arc::clone(&t));
            t
        };
        Ok(Token {
            event: self.progress.event()?,
            lsn,
            commit_time: self.commit_time,
            topic,
            dead_letter,
        })
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
