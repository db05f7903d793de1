//! The quarantine in the relay's core (`on_failure = "quarantine"`, see
//! [`crate::quarantine`]): events of held aggregates are held instead of
//! sent, a failing event holds its aggregate, a held event counts as
//! delivered once its write committed, and released records go out in
//! their aggregate's order.

use std::sync::Arc;

use bytes::Bytes;
use sink_core::{DeliveryError, DeliveryErrorKind, Record};
use tokio::time::Instant;

use super::{Core, Mode, Observation};
use crate::mapping::ID_HEADER;
use crate::progress::Ack;
use crate::quarantine::{HeldEvent, HeldKey, Place, QuarantineError, ReleaseId, Step};
use crate::relay::{Carries, RunError, Token};

/// The kind of a held event the broker refused: held as it was sent.
const REFUSED: &str = "refused";

/// Why an event is held.
pub(in crate::relay) enum Why<'e> {
    /// Its aggregate is held.
    Behind,
    /// It cannot be mapped.
    Unmappable(&'e str),
    /// The broker refused it for good.
    Refused(&'e str),
    /// Its payload does not fit its schema.
    Invalid(&'e str),
}

impl Core<'_> {
    /// True when the quarantine is on and holds `key`.
    pub(super) fn holds(&self, key: &[u8]) -> bool {
        self.quarantine.as_ref().is_some_and(|q| q.holds(key))
    }

    /// True when the quarantine is on.
    pub(in crate::relay) fn quarantines(&self) -> bool {
        self.quarantine.is_some()
    }

    /// Holds `record`, the event of `token`; stops past the maximum.
    pub(super) fn hold(
        &mut self,
        record: Record<()>,
        token: Token,
        why: Why<'_>,
    ) -> Result<(), RunError> {
        let q = self.quarantine.as_mut().expect("the quarantine is on");
        let Some(key) = record.key.clone() else {
            return Err(QuarantineError::NoKey(format!("the event at {}", token.lsn)).into());
        };
        let (kind, error) = match why {
            Why::Behind => (
                "held",
                "held behind an earlier event of its aggregate".to_owned(),
            ),
            Why::Unmappable(e) => ("unmappable", e.to_owned()),
            Why::Refused(e) => (REFUSED, e.to_owned()),
            Why::Invalid(e) => ("invalid", e.to_owned()),
        };
        if !matches!(why, Why::Behind) && !q.holds(&key) {
            self.effects.observe(Observation::Holding {
                key: key.clone(),
                lsn: token.lsn,
                error: error.clone(),
            });
        }
        let event = HeldEvent {
            place: Place {
                commit_lsn: token.commit_lsn,
                index: token.index,
            },
            lsn: token.lsn,
            key,
            record,
            kind: kind.to_owned(),
            error,
        };
        q.hold(event, token)?;
        Ok(())
    }

    /// A refused event of the current session, with the quarantine on:
    /// held, with the records of its aggregate still waiting to be sent.
    pub(super) fn hold_refused(
        &mut self,
        token: Token,
        error: DeliveryError,
        returned: Option<Record<()>>,
    ) -> Result<(), RunError> {
        let returned = match returned {
            Some(r) if error.kind == DeliveryErrorKind::Permanent && r.key.is_some() => r,
            _ => return Err(self.delivery_failed(&token, error)),
        };
        let key = returned.key.clone().expect("checked");
        self.hold(returned, token, Why::Refused(&error.message))?;
        self.hold_waiting(&key)
    }

    /// The first waiting record does not fit its schema, with the
    /// quarantine on: a released one stops its release (the aggregate's
    /// released records not sent yet stay held, in the table); any other
    /// holds its aggregate, with the aggregate's records still waiting.
    pub(super) fn hold_invalid(
        &mut self,
        error: crate::schema_registry::SchemaError,
    ) -> Result<(), RunError> {
        let (record, token) = self
            .outgoing
            .pop_front()
            .expect("a record is waiting")
            .split_token();
        let key = record.key.clone();
        if let Some(release) = token.released() {
            self.end_release(release, error.to_string());
            return Ok(());
        }
        self.hold(record, token, Why::Invalid(&error.to_string()))?;
        match key {
            Some(key) => self.hold_waiting(&key),
            None => Ok(()),
        }
    }

    /// Holds the records of aggregate `key` still waiting to be sent: they
    /// come after one just held.
    fn hold_waiting(&mut self, key: &Bytes) -> Result<(), RunError> {
        let waiting = std::mem::take(&mut self.outgoing);
        for record in waiting {
            if record.key.as_ref() == Some(key) && record.token.released().is_none() {
                let (record, token) = record.split_token();
                self.hold(record, token, Why::Behind)?;
            } else {
                self.outgoing.push_back(record);
            }
        }
        Ok(())
    }

    /// The report of a record of `release`: matched to that release, so a
    /// failed release's late reports count for nothing in the next one.
    pub(super) fn on_released_report(
        &mut self,
        release: ReleaseId,
        result: Result<(), DeliveryError>,
    ) {
        let q = self
            .quarantine
            .as_mut()
            .expect("only the quarantine releases");
        match result {
            Ok(()) => {
                let rest = q.on_release_acked(release);
                self.queue_released(release, rest);
            }
            Err(e) => self.end_release(release, e.to_string()),
        }
    }

    /// A record of `release` was refused again (by the broker, or its
    /// schema): the release ends, and its records not sent yet are not
    /// sent (they stay held, for the next release).
    fn end_release(&mut self, release: ReleaseId, error: String) {
        let q = self
            .quarantine
            .as_mut()
            .expect("only the quarantine releases");
        if let Some(key) = q.on_release_refused(release, error.clone()) {
            self.effects
                .observe(Observation::ReleaseRefused { key, error });
        }
        self.outgoing
            .retain(|r| r.token.released() != Some(release));
    }

    /// The session's next quarantine step, if any.
    /// Only [`Step::Write`] when `writes_only`.
    pub(in crate::relay) fn quarantine_step(&mut self, writes_only: bool) -> Option<Step> {
        let q = self.quarantine.as_mut()?;
        if writes_only {
            return q.has_pending().then_some(Step::Write);
        }
        let step = q.next_step();
        if let Some(Step::Load { key, after: None }) = &step {
            self.effects
                .observe(Observation::Releasing { key: key.clone() });
        }
        step
    }

    /// The poll timer fired.
    pub(in crate::relay) fn quarantine_poll(&mut self) {
        if let Some(q) = &mut self.quarantine {
            q.poll_now();
        }
    }

    /// The held events waiting to be written, for [`Step::Write`].
    pub(in crate::relay) fn take_held(&mut self) -> (Vec<HeldEvent>, Vec<Token>) {
        let q = self.quarantine.as_mut().expect("the quarantine is on");
        q.take_pending().into_iter().unzip()
    }

    /// The held events of `tokens` were written (`new` of them were not
    /// held before): they count as delivered.
    pub(in crate::relay) fn on_held_written(
        &mut self,
        tokens: Vec<Token>,
        new: u64,
        now: Instant,
    ) -> Result<(), RunError> {
        let q = self.quarantine.as_mut().expect("the quarantine is on");
        q.on_written(new);
        self.effects.observe(Observation::Held { new });
        let mut update = None;
        for token in tokens {
            if let Ack::Current(u) = self.progress.ack(token.event, now)? {
                update = u.or(update);
            }
        }
        self.quarantine_gauges();
        self.effects.status(update);
        Ok(())
    }

    /// Every held aggregate read, and the number of held events.
    pub(in crate::relay) fn on_quarantine_synced(&mut self, keys: Vec<HeldKey>, events: u64) {
        let q = self.quarantine.as_mut().expect("the quarantine is on");
        q.on_synced(keys, events);
        self.quarantine_gauges();
    }

    /// The requests read.
    pub(in crate::relay) fn on_quarantine_polled(&mut self, requests: Vec<HeldKey>) {
        let q = self.quarantine.as_mut().expect("the quarantine is on");
        q.on_polled(requests);
    }

    /// A batch of the released aggregate's events was read: queued to be
    /// sent, in order.
    pub(in crate::relay) fn on_release_loaded(&mut self, batch: Vec<HeldEvent>) {
        let q = self.quarantine.as_mut().expect("the quarantine is on");
        if let Some((release, first)) = q.on_loaded(batch) {
            self.queue_released(release, first);
        }
    }

    /// Queues released events' records, in order.
    fn queue_released(&mut self, release: ReleaseId, events: Vec<HeldEvent>) {
        for held in events {
            // Its receipt, once acknowledged, under the id it carries.
            let event_id = self
                .config
                .receipts
                .as_ref()
                .and_then(|_| held.record.headers.iter().find(|h| h.name == ID_HEADER))
                .map(|h| String::from_utf8_lossy(&h.value).into());
            let token = Token {
                event: self.progress.marker(),
                lsn: held.lsn,
                commit_lsn: held.place.commit_lsn,
                index: held.place.index,
                commit_time: pgoutput_decoder::PgTimestamp::default(),
                topic: Arc::clone(&held.record.topic),
                event_id,
                read: None,
                sent: None,
                carries: Carries::Released {
                    release,
                    // The broker refused it as it was sent (serialized, or
                    // a claim-check pointer): released as it was sent. One
                    // held behind another, invalid or unmappable was held
                    // as the row gave it, and is serialized as it goes out.
                    serialized: held.kind == REFUSED,
                },
            };
            self.outgoing.push_back(held.record.with_token(token));
        }
    }

    /// The acknowledged batch's `deleted` events were deleted.
    pub(in crate::relay) fn on_release_deleted(&mut self, deleted: u64) {
        let q = self.quarantine.as_mut().expect("the quarantine is on");
        q.on_released(deleted);
        self.quarantine_gauges();
    }

    /// `key` was forgotten (released or dropped; `deleted` events gone).
    pub(in crate::relay) fn on_key_forgotten(&mut self, key: &Bytes, deleted: u64) {
        let q = self.quarantine.as_mut().expect("the quarantine is on");
        if deleted > 0 {
            self.effects.observe(Observation::DroppedHeld {
                key: key.clone(),
                events: deleted,
            });
        }
        if q.on_forgotten(key, deleted) {
            self.effects
                .observe(Observation::FlowsAgain { key: key.clone() });
        }
        self.quarantine_gauges();
    }

    /// A failed release was recorded.
    pub(in crate::relay) fn on_release_failed_recorded(&mut self) {
        if let Some(q) = &mut self.quarantine {
            q.on_release_failed_recorded();
        }
    }

    fn quarantine_gauges(&mut self) {
        if let Some(q) = &self.quarantine {
            self.effects.observe(Observation::Quarantined {
                aggregates: q.aggregates(),
                events: q.events(),
            });
        }
    }

    /// The place of the next event of the open transaction.
    pub(super) fn next_index(&mut self) -> u64 {
        match &mut self.mode {
            Mode::ExactlyOnce(t) => t.current_index(),
            Mode::AtLeastOnce { next_index } => {
                let index = *next_index;
                *next_index += 1;
                index
            }
        }
    }
}
