//! The session's handlers: what each replication message and each delivery
//! report does to the progress, the outgoing records and the metrics. They
//! never wait: the loop in `session.rs` does all the waiting.

use std::sync::Arc;

use pgoutput_decoder::{
    Decoder, LogicalMessage, Lsn, PgTimestamp, ReplicationMessage, StandbyStatusUpdate, TupleData,
};
use sink_kafka::{Record, Report};
use tokio::time::Instant;

use super::session::Session;
use super::{Deliveries, Destination, RunError, Token};
use crate::dead_letter::{failure_kind, DeadLetterKind, Origin};
use crate::mapping::ColumnIndexes;
use crate::metrics::{KindLabels, TopicLabel};
use crate::progress::Ack;

impl<D: Destination, R: Deliveries> Session<'_, D, R> {
    /// A delivery report: ack the event, dead-letter it, or stop.
    pub(super) fn on_report(
        &mut self,
        report: Report<Token>,
    ) -> Result<Option<StandbyStatusUpdate>, RunError> {
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
    pub(super) fn on_message(
        &mut self,
        decoder: &mut Decoder,
        message: ReplicationMessage,
    ) -> Result<Option<StandbyStatusUpdate>, RunError> {
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
        tuple: &TupleData,
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
        let topic = if let Some(t) = self.topics.get(topic) {
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
