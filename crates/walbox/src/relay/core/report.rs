//! Delivery reports: an acknowledged event moves the progress; a refused
//! one is dead-lettered or stops the relay.

use std::sync::Arc;

use pgoutput_decoder::PgTimestamp;
use sink_core::{Delivered, DeliveryError, Report};
use tokio::time::Instant;

use super::{Core, Observation, Split};
use crate::dead_letter::DeadLetterKind;
use crate::progress::Ack;
use crate::relay::{RunError, Token};

impl Core<'_> {
    /// A delivery report received at `now` (`wall`, on the wall clock): ack
    /// the event, dead-letter it, or stop.
    pub(in crate::relay) fn handle_report(
        &mut self,
        report: Report<Token>,
        now: Instant,
        wall: PgTimestamp,
    ) -> Result<(), RunError> {
        if self.mode.exactly_once() {
            return self.on_transactional_report(report, now);
        }
        let Report {
            token,
            result,
            returned,
            client_micros,
        } = report;
        if let Some(release) = token.released() {
            if self.progress.is_current(token.event) {
                let result = match result {
                    Ok(at) => {
                        self.effects.observe(Observation::Released { token, at });
                        Ok(())
                    }
                    Err(e) => Err(e),
                };
                self.on_released_report(release, result);
            }
            return Ok(());
        }
        match result {
            Ok(at) => {
                self.sampled(&token, &at);
                let update = match self.progress.ack(token.event, now)? {
                    Ack::Current(update) => update,
                    Ack::Stale => {
                        // Re-sent by the new session; this copy landed too.
                        self.effects
                            .observe(Observation::Acknowledged { token, at });
                        return Ok(());
                    }
                };
                let split = Split::of(&token, now, client_micros);
                self.delivered(token, Some(at), wall, split);
                self.effects.status(update);
                Ok(())
            }
            Err(error) => {
                if !self.progress.is_current(token.event) {
                    // Its transaction is re-sent by the new session.
                    self.effects.observe(Observation::StaleFailure {
                        error: error.to_string(),
                    });
                    return Ok(());
                }
                if token.dead_letter().is_some() {
                    return Err(self.dead_letter_failed(&token, error));
                }
                if self.quarantines() {
                    return self.hold_refused(token, error, returned);
                }
                let copy = token.clone().into_dead_letter(DeadLetterKind::Refused);
                match self
                    .config
                    .dead_letters
                    .refused(&error, returned, token.lsn, copy)
                {
                    Some(record) => {
                        self.effects.observe(Observation::DeadLettering {
                            why: "broker refused an event; dead-lettering it",
                            error: error.to_string(),
                            topic: Some(Arc::clone(&token.topic)),
                            lsn: token.lsn,
                            dead_letter_topic: Arc::clone(&record.topic),
                        });
                        self.outgoing.push_back(record);
                        Ok(())
                    }
                    None => Err(self.delivery_failed(&token, error)),
                }
            }
        }
    }

    /// A sampled event's acknowledgement, for the continuous audit.
    pub(super) fn sampled(&mut self, token: &Token, at: &Delivered) {
        if let (true, Some(id)) = (token.sampled(), &token.event_id) {
            self.effects.observe(Observation::Sampled {
                event_id: id.clone(),
                topic: Arc::clone(&token.topic),
                at: at.clone(),
            });
        }
    }

    /// An event delivered at `wall` (at least once: acknowledged `at`;
    /// exactly once: its transaction committed).
    pub(super) fn delivered(
        &mut self,
        token: Token,
        at: Option<Delivered>,
        wall: PgTimestamp,
        split: Option<Split>,
    ) {
        if token.dead_letter().is_some() {
            self.dead_lettered += 1;
        }
        self.effects.observe(Observation::Delivered {
            token,
            at,
            wall,
            split,
        });
    }

    /// A dead-letter copy that failed: walbox stops.
    pub(super) fn dead_letter_failed(&mut self, token: &Token, error: DeliveryError) -> RunError {
        self.effects.observe(Observation::Stopping {
            what: "the dead-letter copy failed",
            error: error.to_string(),
            lsn: token.lsn,
        });
        RunError::DeadLetter(error)
    }

    /// A delivery that failed and stops walbox: noted, returned.
    pub(super) fn delivery_failed(&mut self, token: &Token, error: DeliveryError) -> RunError {
        self.effects.observe(Observation::DeliveryFailed {
            topic: Arc::clone(&token.topic),
            kind: error.kind,
            error: error.to_string(),
            lsn: token.lsn,
        });
        RunError::Delivery(error)
    }
}
