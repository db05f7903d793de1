//! Coverage readings: whether the publication still publishes the outbox
//! table's INSERTs as it did, and up to where that is verified.

use pgoutput_decoder::Lsn;
use slot_manager::{describe_change, ChangeInFlight, Coverage};
use tokio::time::Instant;

use super::{Core, Observation};
use crate::relay::{DriftError, RunError};

/// How long a change of the coverage may stay in flight before walbox says
/// that confirmation waits for it.
const PENDING_CHANGE_REPORT: std::time::Duration = std::time::Duration::from_secs(10);

impl Core<'_> {
    /// A coverage reading: a gap or a change stops the relay; otherwise the
    /// reading's own position is verified, unless a change of the coverage
    /// was in flight.
    pub(in crate::relay) fn on_coverage(
        &mut self,
        reading: Coverage,
        now: Instant,
    ) -> Result<(), RunError> {
        let held = self.progress.confirmable();
        let committed = self.progress.delivered_commit_time().map(|(_, t)| t);
        if let Some(gap) = &reading.gap {
            self.effects.observe(Observation::Stopping {
                what: "the outbox table is not published",
                error: gap.to_string(),
                lsn: held,
            });
            return Err(RunError::Drift(DriftError::NotPublished {
                gap: gap.clone(),
                remedy: DriftError::remedy(&self.config.tables),
                held,
                committed,
            }));
        }
        if let Some(before) = &self.coverage {
            for table in dropped(before, &reading) {
                self.effects.observe(Observation::TableDropped { table });
            }
            if let Some(what) = changed(before, &reading) {
                self.effects.observe(Observation::Stopping {
                    what: "the publication's coverage changed",
                    error: format!(
                        "{what} (coverage before: {}, now: {})",
                        before.fingerprint, reading.fingerprint
                    ),
                    lsn: held,
                });
                return Err(RunError::Drift(DriftError::Changed {
                    change: what,
                    held,
                    tables: self.config.tables.clone(),
                    remedy: DriftError::remedy(&self.config.tables),
                    committed,
                }));
            }
        }
        // A reading verifies the coverage up to its own position when no
        // change of it was in flight; while one is, nothing (see
        // `slot_manager::ChangeInFlight`).
        let verified = match reading.in_flight {
            ChangeInFlight::Nothing => Some(reading.wal_lsn),
            ChangeInFlight::Pending => None,
        };
        self.note_pending_change(reading.in_flight == ChangeInFlight::Pending, held, now);
        self.coverage = Some(reading);
        let update = verified.and_then(|lsn| self.progress.covered(lsn, now));
        self.effects.status(update);
        Ok(())
    }

    /// Says once when a change of the publication or the table stays in
    /// flight for long: confirmation waits for it.
    fn note_pending_change(&mut self, pending: bool, held: Lsn, now: Instant) {
        match (pending, self.change_pending_since) {
            (false, _) => self.change_pending_since = None,
            (true, None) => self.change_pending_since = Some((now, false)),
            (true, Some((since, false))) if now - since >= PENDING_CHANGE_REPORT => {
                self.effects.observe(Observation::ChangePending {
                    slot: held,
                    waited: now - since,
                });
                self.change_pending_since = Some((since, true));
            }
            (true, Some(_)) => {}
        }
    }
}

/// What changed between two readings that could hide an event, in words:
/// with one table, any change of its coverage; with several, a change of
/// a table's coverage, or a table joining the publication that walbox did
/// not pick up itself. A table that left the readings was dropped (one
/// that left the publication while it exists is the reading's gap).
fn changed(before: &Coverage, now: &Coverage) -> Option<String> {
    if before.tables.is_empty() && now.tables.is_empty() {
        return (before.fingerprint != now.fingerprint).then(|| describe_change(before, now));
    }
    for b in &before.tables {
        match now.tables.iter().find(|n| n.table == b.table) {
            Some(n) if n.fingerprint != b.fingerprint => {
                return Some(match (b.oid, n.oid) {
                    (Some(x), Some(y)) if x != y => format!(
                        "outbox table {} was dropped and recreated (OID {x} → {y})",
                        b.table
                    ),
                    _ => format!(
                        "the publication's coverage of outbox table {} changed (altered, or the table removed from it and added back)",
                        b.table
                    ),
                });
            }
            Some(_) | None => {}
        }
    }
    now.tables
        .iter()
        .find(|n| {
            !before.tables.iter().any(|b| b.table == n.table) && !now.added.contains(&n.table)
        })
        .map(|n| {
            format!(
                "outbox table {} joined the publication, added by someone else (rows written to it before were not streamed, unless it never held one)",
                n.table
            )
        })
}

/// The tables of `before` that left the readings: dropped.
fn dropped(before: &Coverage, now: &Coverage) -> Vec<String> {
    before
        .tables
        .iter()
        .filter(|b| !now.tables.iter().any(|n| n.table == b.table))
        .map(|b| b.table.to_string())
        .collect()
}
