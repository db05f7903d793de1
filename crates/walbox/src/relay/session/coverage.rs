//! Reading the publication's coverage of the outbox tables, for the core
//! to verify (see the relay's "Coverage").

use std::time::Duration;

use tokio::time::Instant;

use super::{presumed_dead, Session};
use crate::relay::{Deliveries, Destination, ReplicationStream, RunError, Token, Transactional};

/// How often the publication's coverage of the outbox table is read while
/// no delivered event waits for it. A reading verifies the coverage up to
/// its own WAL position when no change of it is in flight, and nothing
/// while one is (see `slot_manager::ChangeInFlight`).
pub(in crate::relay) const COVERAGE_INTERVAL: Duration = Duration::from_millis(250);
/// How often the coverage is read while delivered events wait for it to be
/// verified: what a crash re-sends is what waits here. Measured
/// (`scripts/torture --only kill-9`, 10 kills under 3,000 events/s, 3 runs):
/// 11,740–12,963 duplicates when a reading verified the one 250 ms before
/// it; 4,165 (one run) with self-verifying readings every 100 ms and
/// 100 ms between status updates; 1,665–1,970 at 50 ms and 50 ms. A
/// prepared reading costs the primary ~0.24 ms.
pub(in crate::relay) const COVERAGE_WHILE_WAITING: Duration = Duration::from_millis(50);
/// How long a coverage reading may take before the session is deemed broken.
pub(super) const COVERAGE_TIMEOUT: Duration = Duration::from_secs(10);

impl<D, X, R> Session<'_, D, X, R>
where
    D: Destination<Token>,
    X: Transactional<Token>,
    R: Deliveries<Token>,
{
    /// Reads the coverage and applies it; sends the status update due.
    pub(super) async fn check_coverage<S: ReplicationStream>(
        &mut self,
        stream: &mut S,
    ) -> Result<(), RunError> {
        let reading = tokio::time::timeout(COVERAGE_TIMEOUT, stream.coverage())
            .await
            .map_err(|_| presumed_dead("the publication check", COVERAGE_TIMEOUT))??;
        let result = self.core.on_coverage(reading, Instant::now());
        self.effects(stream).await?;
        result
    }

    /// Verifies the coverage up to now before the final confirmation: one
    /// reading now, and when a change was in flight, one more a little
    /// later.
    pub(super) async fn verify_coverage_now<S: ReplicationStream>(
        &mut self,
        stream: &mut S,
    ) -> Result<(), RunError> {
        if !self.core.awaiting_coverage() {
            return Ok(());
        }
        self.check_coverage(stream).await?;
        if self.core.awaiting_coverage() {
            tokio::time::sleep(COVERAGE_WHILE_WAITING).await;
            self.check_coverage(stream).await?;
        }
        Ok(())
    }
}
