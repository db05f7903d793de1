//! The relay: replication stream → decoder → outbox mapping → Kafka, with
//! the ack tracker deciding what may be confirmed.
//!
//! ```text
//! slot ─► XLogData ─► Decoder ─► Begin/Insert/Commit ─► mapping ─► Sink::send ─► broker
//!   ▲                                   │ tracker.begin/event/commit         │
//!   └── status update (flush = tracker.confirmable) ◄── tracker.ack ◄── Reports::next
//! ```
//!
//! The loop handles delivery reports before new input (`biased`), stops
//! reading the socket while the sink is full (TCP pushes back on the
//! walsender) but keeps sending status updates, reconnects to Postgres with
//! exponential backoff and jitter, and on shutdown stops reading, drains
//! deliveries within a bound and sends a final status update.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgoutput_decoder::{
    DecodeError, Decoder, LogicalMessage, Lsn, PgTimestamp, ReplicationMessage,
};
use sink_kafka::{DeliveryError, Record, Report, Reports, Sink, SinkError};
use slot_manager::{
    connect_control, preflight, start_streaming, Feedback, LogicalReplicationStream,
    ReplicationOptions,
};
use tokio::sync::watch;
use tokio_postgres::Client;

use crate::acks::{AckError, AckTracker, EventToken};
use crate::config::Settings;
use crate::mapping::{ColumnIndexes, MapError};
use crate::metrics::{FailureLabels, Metrics, TopicLabel};

/// What travels with an event to the broker and back.
#[derive(Debug)]
pub struct Token {
    event: EventToken,
    commit_time: PgTimestamp,
    topic: Arc<str>,
}

/// How often the slot's retained WAL is sampled for the metrics.
const SLOT_SAMPLE_INTERVAL: Duration = Duration::from_secs(10);

/// Why the relay stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// Postgres (connection, slot, preflight).
    #[error(transparent)]
    Postgres(#[from] slot_manager::Error),
    /// A row could not be mapped and no dead-letter topic is configured.
    #[error(
        "{0}; the slot stays before this event (configure a dead-letter topic to skip such rows)"
    )]
    Map(#[from] MapError),
    /// The broker refused an event for good, or the producer failed.
    #[error("{0}; the slot stays before this event")]
    Delivery(DeliveryError),
    /// The producer could not be created.
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// The brokers did not answer at startup.
    #[error("Kafka brokers {brokers} did not answer within 10 s")]
    Broker {
        /// The bootstrap list.
        brokers: String,
        /// Why.
        #[source]
        source: SinkError,
    },
    /// The stream broke the transaction rules.
    #[error(transparent)]
    Protocol(#[from] AckError),
    /// A replication message could not be decoded.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// Unexpected message for the negotiated protocol.
    #[error("unexpected {0} message: walbox streams with protocol 1 and no streaming")]
    Unexpected(char),
}

impl RunError {
    fn is_transient(&self) -> bool {
        matches!(self, RunError::Postgres(e) if e.is_transient())
    }
}

/// The least time between two status updates sent because the confirmed
/// position moved.
const EAGER_STATUS_GAP: Duration = Duration::from_millis(100);

/// How long the brokers may take to answer at startup.
const BROKER_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// How a streaming session ended without error.
enum SessionEnd {
    Shutdown,
}

/// Exponential backoff with jitter: 0.5 s doubling to 30 s, ±25 %.
struct Backoff {
    next: Duration,
    seed: u64,
}

impl Backoff {
    const MIN: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(30);

    fn new() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1;
        Backoff {
            next: Self::MIN,
            seed,
        }
    }

    fn reset(&mut self) {
        self.next = Self::MIN;
    }

    fn delay(&mut self) -> Duration {
        // xorshift64: jitter needs no cryptographic randomness.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let jitter = 0.75 + (self.seed % 1000) as f64 / 2000.0;
        let d = self.next.mul_f64(jitter);
        self.next = (self.next * 2).min(Self::MAX);
        d
    }
}

/// Runs until `shutdown` turns true (then returns `Ok`) or a definite error.
pub async fn run(
    settings: &Settings,
    mut shutdown: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
) -> Result<(), RunError> {
    let sink_config = settings
        .kafka
        .clone()
        .expect("`walbox run` settings carry the Kafka configuration");
    let max_in_flight = sink_config.max_in_flight;
    let (sink, mut reports) = Sink::<Token>::new(&sink_config)?;
    // Fail fast on a broker that is not there at all; once running, an
    // outage only stalls deliveries (the outbox in Postgres is the buffer).
    if let Err(e) = sink.check_brokers(BROKER_CHECK_TIMEOUT).await {
        return Err(RunError::Broker {
            brokers: sink_config.bootstrap_servers.clone(),
            source: e,
        });
    }
    let mut backoff = Backoff::new();
    let result = loop {
        let mut session = Session::new(
            settings,
            &sink,
            &mut reports,
            max_in_flight,
            Arc::clone(&metrics),
        );
        let result = session.run(&mut shutdown, &mut backoff).await;
        metrics.set_streaming(false);
        match result {
            Ok(SessionEnd::Shutdown) => break Ok(()),
            Err(e) if e.is_transient() => {
                let delay = backoff.delay();
                tracing::warn!(error = %e, retry_in = ?delay, "not streaming; will retry");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.changed() => break Ok(()),
                }
            }
            Err(e) => break Err(e),
        }
    };
    // Flush what is left; anything unacked was never confirmed.
    let leftover = sink_kafka::shutdown(sink, reports, Duration::from_secs(5)).await;
    if !leftover.is_empty() {
        tracing::info!(
            count = leftover.len(),
            "deliveries finished during shutdown (not confirmed; resent after restart)"
        );
    }
    result
}

/// One replication connection's worth of state.
struct Session<'a> {
    settings: &'a Settings,
    sink: &'a Sink<Token>,
    reports: &'a mut Reports<Token>,
    max_in_flight: usize,
    tracker: AckTracker,
    feedback: Feedback,
    /// Outbox relations by OID (the root table; partitions publish as the root).
    outbox: HashMap<u32, Result<ColumnIndexes, MapError>>,
    /// The open transaction's commit time (from Begin).
    commit_time: PgTimestamp,
    /// Topic names shared by the tokens of their events.
    topics: HashMap<String, Arc<str>>,
    metrics: Arc<Metrics>,
}

impl<'a> Session<'a> {
    fn new(
        settings: &'a Settings,
        sink: &'a Sink<Token>,
        reports: &'a mut Reports<Token>,
        max_in_flight: usize,
        metrics: Arc<Metrics>,
    ) -> Self {
        Session {
            settings,
            sink,
            reports,
            max_in_flight,
            tracker: AckTracker::new(Lsn::ZERO),
            feedback: Feedback::new(Lsn::ZERO, settings.status_interval),
            outbox: HashMap::new(),
            commit_time: PgTimestamp::default(),
            topics: HashMap::new(),
            metrics,
        }
    }

    async fn run(
        &mut self,
        shutdown: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
    ) -> Result<SessionEnd, RunError> {
        let s = self.settings;
        let control = connect_control(&s.pg).await?;
        preflight(&control, &s.table, &s.mapping.required_columns(), None).await?;
        let options = ReplicationOptions::new(s.publication.clone());
        let (mut stream, status) =
            start_streaming(&s.pg, &control, &s.slot, Lsn::ZERO, &options).await?;
        backoff.reset();
        self.metrics.set_streaming(true);
        let start = status.confirmed_flush_lsn.unwrap_or(Lsn::ZERO);
        self.tracker = AckTracker::new(start);
        // Confirm acknowledged work promptly (at most every 100 ms), so a
        // crash re-sends little beyond what was in flight.
        self.feedback = Feedback::new(start, s.status_interval).with_eager_gap(EAGER_STATUS_GAP);
        tracing::info!(slot = %s.slot, lsn = %start, "streaming from the slot");

        let result = self.stream(&mut stream, &control, shutdown).await;
        match &result {
            Ok(SessionEnd::Shutdown) => {
                self.drain(Some(s.shutdown_timeout)).await?;
                let update = self.feedback.update(false);
                if let Err(e) = stream.send_standby_status_update(update).await {
                    tracing::warn!(error = %e, "could not send the final status update");
                } else {
                    tracing::info!(lsn = %update.flush, "confirmed on shutdown");
                }
                stream.close().await;
            }
            Err(e) if e.is_transient() => {
                // In-flight events belong to this session's tracker: wait for
                // their reports before a new session reuses the sink.
                self.tracker.abandon_open();
                self.drain(None).await?;
            }
            Err(_) => {
                // Confirm what is safely delivered before stopping.
                let _ = stream
                    .send_standby_status_update(self.feedback.update(false))
                    .await;
            }
        }
        result
    }

    async fn stream(
        &mut self,
        stream: &mut LogicalReplicationStream,
        control: &Client,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<SessionEnd, RunError> {
        let mut decoder = Decoder::new(1).expect("version 1 is supported");
        // Both timers live across iterations and are reset only when their
        // deadline moves. A fresh `sleep_until` per iteration registers with
        // the runtime's timer wheel every time, and from this thread that
        // wakes the driver thread: once per message, ~17% of walbox's CPU in
        // a backlog drain.
        let sample = tokio::time::sleep_until(tokio::time::Instant::now());
        tokio::pin!(sample);
        let status_due = tokio::time::sleep_until(self.feedback.next_due().into());
        tokio::pin!(status_due);
        loop {
            self.update_gauges();
            let can_read = self.sink.in_flight() < self.max_in_flight;
            let due = tokio::time::Instant::from_std(self.feedback.next_due());
            if status_due.deadline() != due {
                status_due.as_mut().reset(due);
            }
            tokio::select! {
                biased;
                report = self.reports.next() => {
                    self.on_report(report.expect("the sink outlives the session"))?;
                    if let Some(update) = self.feedback.poll_update(Instant::now(), false, true) {
                        stream.send_standby_status_update(update).await?;
                    }
                }
                _ = shutdown.changed() => return Ok(SessionEnd::Shutdown),
                () = &mut sample => {
                    let next = sample.deadline() + SLOT_SAMPLE_INTERVAL;
                    sample.as_mut().reset(next);
                    // Metrics only: a failed sample is not worth stopping for.
                    if let Ok(Some(status)) = slot_manager::slot_status(control, &self.settings.slot).await {
                        self.metrics.retained_wal_bytes.set(status.retained_wal_bytes.unwrap_or(0));
                    }
                }
                () = &mut status_due => {
                    if let Some(update) = self.feedback.poll_update(Instant::now(), false, true) {
                        stream.send_standby_status_update(update).await?;
                    }
                }
                message = stream.next_message(), if can_read => {
                    let reply = self.on_message(&mut decoder, message?).await?;
                    if let Some(update) = self.feedback.poll_update(Instant::now(), reply, true) {
                        stream.send_standby_status_update(update).await?;
                    }
                }
            }
        }
    }

    fn on_report(&mut self, report: Report<Token>) -> Result<(), RunError> {
        let Token {
            event,
            commit_time,
            topic,
        } = report.token;
        match report.result {
            Ok(_) => {
                let confirmable = self.tracker.ack(event)?;
                self.feedback.confirm(confirmable);
                self.metrics
                    .published
                    .get_or_create(&TopicLabel {
                        topic: topic.to_string(),
                    })
                    .inc();
                let micros = PgTimestamp::now().as_unix_micros() - commit_time.as_unix_micros();
                self.metrics
                    .commit_to_ack
                    .observe(micros.max(0) as f64 / 1e6);
                Ok(())
            }
            Err(e) => {
                self.metrics
                    .failed
                    .get_or_create(&FailureLabels {
                        topic: topic.to_string(),
                        kind: format!("{:?}", e.kind),
                    })
                    .inc();
                Err(RunError::Delivery(e))
            }
        }
    }

    fn update_gauges(&self) {
        let m = &self.metrics;
        m.in_flight_events.set(self.sink.in_flight() as i64);
        m.in_flight_bytes.set(self.sink.in_flight_bytes() as i64);
        m.received_lsn
            .set(self.feedback.last_received().as_u64() as i64);
        m.confirmed_lsn
            .set(self.feedback.confirmed().as_u64() as i64);
    }

    /// The token for an event of the open transaction bound for `topic`.
    fn token(&mut self, topic: &str) -> Result<Token, RunError> {
        let topic = match self.topics.get(topic) {
            Some(t) => Arc::clone(t),
            None => {
                let t: Arc<str> = Arc::from(topic);
                self.topics.insert(topic.to_owned(), Arc::clone(&t));
                t
            }
        };
        Ok(Token {
            event: self.tracker.event()?,
            commit_time: self.commit_time,
            topic,
        })
    }

    /// Handles one frame; returns whether the server asked for a reply.
    async fn on_message(
        &mut self,
        decoder: &mut Decoder,
        message: ReplicationMessage,
    ) -> Result<bool, RunError> {
        let xlog = match message {
            ReplicationMessage::PrimaryKeepalive(k) => {
                self.feedback.received(k.wal_end());
                let confirmable = self.tracker.keepalive(k.wal_end());
                self.feedback.confirm(confirmable);
                return Ok(k.reply_requested());
            }
            ReplicationMessage::XLogData(x) => x,
            _ => return Ok(false),
        };
        self.feedback.received(xlog.wal_end());
        let lsn = xlog.wal_start();
        match decoder.decode(xlog.into_data())? {
            LogicalMessage::Begin(b) => {
                self.tracker.begin(b.final_lsn())?;
                self.commit_time = b.commit_time();
            }
            LogicalMessage::Commit(c) => {
                let confirmable = self.tracker.commit(c.commit_lsn(), c.end_lsn())?;
                self.feedback.confirm(confirmable);
            }
            LogicalMessage::Relation(r) => {
                let table = &self.settings.table;
                if r.namespace() == table.schema() && r.name() == table.name() {
                    self.outbox
                        .insert(r.oid(), self.settings.mapping.resolve(&r));
                }
            }
            LogicalMessage::Insert(insert) => {
                let Some(columns) = self.outbox.get(&insert.relation_oid()) else {
                    return Ok(false); // another table (publication changed by hand)
                };
                let columns = columns.clone()?;
                match self.settings.mapping.map(&columns, insert.tuple()) {
                    Ok(event) => {
                        tracing::debug!(event_id = %event.event_id, aggregate_id = %event.aggregate_id, %lsn, topic = %event.topic, "event");
                        let token = self.token(&event.topic)?;
                        let record = Record {
                            topic: event.topic,
                            key: Some(event.key),
                            value: event.value,
                            headers: event.headers,
                            timestamp_ms: event.timestamp_ms,
                            token,
                        };
                        self.send(record).await?;
                    }
                    Err(e) => match &self
                        .settings
                        .kafka
                        .as_ref()
                        .and_then(|k| k.dead_letter_topic.clone())
                    {
                        Some(dlq) => {
                            tracing::warn!(error = %e, %lsn, dead_letter_topic = %dlq, "unmappable row sent to the dead-letter topic");
                            let token = self.token(dlq)?;
                            let value = insert.tuple().value_bytes(columns.payload_index());
                            let record = Record::new(dlq.clone(), None, value, token)
                                .with_header(sink_kafka::dlq_headers::ERROR, e.to_string())
                                .with_header(sink_kafka::dlq_headers::ERROR_KIND, "Unmappable");
                            self.send(record).await?;
                        }
                        None => {
                            tracing::error!(error = %e, %lsn, "cannot map an outbox row");
                            return Err(RunError::Map(e));
                        }
                    },
                }
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
        Ok(false)
    }

    /// Waits for room (handling reports meanwhile), then enqueues.
    async fn send(&mut self, record: Record<Token>) -> Result<(), RunError> {
        let size = record.size();
        let permit = loop {
            tokio::select! {
                biased;
                report = self.reports.next() => self.on_report(report.expect("the sink outlives the session"))?,
                permit = self.sink.reserve(size) => break permit,
            }
        };
        self.sink.send(permit, record).await;
        Ok(())
    }

    /// Waits for every in-flight event's report (up to `limit`).
    async fn drain(&mut self, limit: Option<Duration>) -> Result<(), RunError> {
        let deadline = limit.map(|l| tokio::time::Instant::now() + l);
        while self.tracker.unacked_events() > 0 {
            let next = self.reports.next();
            let report = match deadline {
                Some(d) => match tokio::time::timeout_at(d, next).await {
                    Ok(r) => r,
                    Err(_) => {
                        tracing::warn!(unacked = self.tracker.unacked_events(), "shutdown timeout: leaving events unconfirmed (they are resent after restart)");
                        return Ok(());
                    }
                },
                None => next.await,
            };
            self.on_report(report.expect("the sink outlives the session"))?;
        }
        Ok(())
    }
}
