//! Coverage readings: whether the publication still publishes the outbox
//! table's INSERTs as it did, and up to where that is verified.

use pgoutput_decoder::{Lsn, StandbyStatusUpdate};
use slot_manager::{describe_change, ChangeInFlight, Coverage};
use tokio::time::Instant;

use super::Core;
use crate::relay::{DriftError, RunError};

/// How long a change of the coverage may stay in flight before walbox says
/// that confirmation waits for it.
const PENDING_CHANGE_REPORT: std::time::Duration = std::time::Duration::from_secs(10);

impl Core<'_> {
    /// A coverage reading: a gap or a change stops the relay; otherwise the
    /// reading's own position is verified, unless a change of the coverage
    /// was in flight. Returns the status update due.
    pub(in crate::relay) fn on_coverage(
        &mut self,
        reading: Coverage,
    ) -> Result<Option<StandbyStatusUpdate>, RunError> {
        let held = self.progress.confirmable();
        let committed = self.progress.delivered_commit_time().map(|(_, t)| t);
        if let Some(gap) = &reading.gap {
            tracing::error!(%gap, slot = %held, "the outbox table is not published");
            return Err(RunError::Drift(DriftError::NotPublished {
                gap: gap.clone(),
                held,
                committed,
            }));
        }
        let verified = match &self.coverage {
            Some(before) if before.fingerprint != reading.fingerprint => {
                let what = describe_change(before, &reading);
                tracing::error!(change = %what, before = %before.fingerprint, now = %reading.fingerprint, slot = %held, "the publication's coverage changed");
                return Err(RunError::Drift(DriftError::Changed {
                    change: what,
                    held,
                    table: self.config.table.clone(),
                    committed,
                }));
            }
            // A reading verifies the coverage up to its own position when
            // no change of it was in flight; while one is, nothing (see
            // `slot_manager::ChangeInFlight`).
            _ => match reading.in_flight {
                ChangeInFlight::Nothing => Some(reading.wal_lsn),
                ChangeInFlight::Pending => None,
            },
        };
        self.note_pending_change(reading.in_flight == ChangeInFlight::Pending, held);
        self.coverage = Some(reading);
        Ok(verified.and_then(|lsn| self.progress.covered(lsn, Instant::now())))
    }

    /// Says once when a change of the publication or the table stays in
    /// flight for long: confirmation waits for it.
    fn note_pending_change(&mut self, pending: bool, held: Lsn) {
        match (pending, self.change_pending_since) {
            (false, _) => self.change_pending_since = None,
            (true, None) => self.change_pending_since = Some((Instant::now(), false)),
            (true, Some((since, false))) if since.elapsed() >= PENDING_CHANGE_REPORT => {
                tracing::warn!(slot = %held, waited = ?since.elapsed(), "a transaction changing the publication or the outbox table has not ended (open, or waiting for synchronous standbys): the slot is not confirmed past its start until it ends");
                self.change_pending_since = Some((since, true));
            }
            (true, Some(_)) => {}
        }
    }
}
