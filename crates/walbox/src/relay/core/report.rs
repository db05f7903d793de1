//! Delivery reports: an acknowledged event moves the progress; a refused
//! one is dead-lettered or stops the relay.

use std::sync::Arc;
use std::time::SystemTime;

use pgoutput_decoder::{PgTimestamp, StandbyStatusUpdate};
use sink_core::{Delivered, DeliveryError, Report};
use tokio::time::Instant;

use super::Core;
use crate::dead_letter::DeadLetterKind;
use crate::metrics::{KindLabels, TopicLabel};
use crate::progress::Ack;
use crate::receipts::Receipt;
use crate::relay::{RunError, Token};

impl Core<'_> {
    /// A delivery report received at `now` (`wall`, on the wall clock): ack
    /// the event, dead-letter it, or stop.
    pub(in crate::relay) fn on_report(
        &mut self,
        report: Report<Token>,
        now: Instant,
        wall: PgTimestamp,
    ) -> Result<Option<StandbyStatusUpdate>, RunError> {
        if self.eos.is_some() {
            return self.on_transactional_report(report, now).map(|()| None);
        }
        let Report {
            token,
            result,
            returned,
        } = report;
        if let Some(release) = token.released {
            if self.progress.is_current(token.event) {
                if let Ok(at) = &result {
                    self.receipt(&token, at);
                }
                self.on_released_report(release, result.map(|_| ()));
            }
            return Ok(None);
        }
        match result {
            Ok(at) => {
                self.tap_delivered(&token, &at);
                self.receipt(&token, &at);
                let update = match self.progress.ack(token.event, now)? {
                    Ack::Current(update) => update,
                    Ack::Stale => return Ok(None),
                };
                self.count_delivered(&token, wall);
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
                if self.quarantines() {
                    return self.hold_refused(token, error, returned).map(|()| None);
                }
                let copy = Token {
                    dead_letter: Some(DeadLetterKind::Refused),
                    sampled: false,
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
                    None => Err(self.delivery_failed(&token, error)),
                }
            }
        }
    }

    /// A sampled event's acknowledgement, for the continuous audit.
    pub(super) fn tap_delivered(&self, token: &Token, at: &Delivered) {
        if let (Some(tap), Some(id), true) = (&self.config.audit, &token.event_id, token.sampled) {
            tap.delivered(id, &token.topic, at);
        }
    }

    /// An acknowledged event's receipt (at least once; exactly-once refuses
    /// receipts: an acknowledged record may still be aborted).
    fn receipt(&self, token: &Token, at: &Delivered) {
        // A receipt names a Kafka partition and offset (the configuration
        // refuses receipts elsewhere).
        let (Some(recorder), Some(id), Some((partition, offset))) =
            (&self.config.receipts, &token.event_id, at.kafka())
        else {
            return;
        };
        {
            // A dead-lettered copy landed on the dead-letter topic.
            let topic = match (token.dead_letter, self.config.dead_letters.topic()) {
                (Some(_), Some(dead_letters)) => Arc::from(dead_letters),
                _ => Arc::clone(&token.topic),
            };
            recorder.record(Receipt {
                event_id: id.clone(),
                topic,
                partition,
                offset,
                acked_at: SystemTime::now(),
                dead_lettered: token.dead_letter.is_some(),
            });
        }
    }

    /// Metrics of an event delivered at `wall` (at least once:
    /// acknowledged; exactly once: its transaction committed).
    pub(super) fn count_delivered(&mut self, token: &Token, wall: PgTimestamp) {
        let topic = self.metrics.topic_label(&token.topic);
        match token.dead_letter {
            Some(kind) => {
                self.dead_lettered += 1;
                self.metrics
                    .dead_lettered
                    .get_or_create(&KindLabels {
                        topic,
                        kind: kind.as_str(),
                    })
                    .inc();
            }
            None => {
                self.metrics
                    .published
                    .get_or_create(&TopicLabel { topic })
                    .inc();
                // A backfilled row has no commit time: no latency.
                if token.commit_time != PgTimestamp::default() {
                    let micros = wall.as_unix_micros() - token.commit_time.as_unix_micros();
                    self.metrics
                        .commit_to_ack
                        .observe(micros.max(0) as f64 / 1e6);
                    self.metrics.commit_to_ack_exact.record(micros);
                }
                if let (Some(spans), Some(span)) = (&self.config.spans, &token.span) {
                    spans.end(span, token.commit_time, &token.topic, token.lsn);
                }
            }
        }
    }

    /// A delivery that failed and stops walbox: counted, logged, returned.
    pub(super) fn delivery_failed(&self, token: &Token, error: DeliveryError) -> RunError {
        self.metrics
            .failed
            .get_or_create(&KindLabels {
                topic: self.metrics.topic_label(&token.topic),
                kind: error.kind.as_str(),
            })
            .inc();
        tracing::error!(%error, topic = %token.topic, lsn = %token.lsn, "delivery failed");
        RunError::Delivery(error)
    }
}
