//! How a session ends: the drain on shutdown, settling the reports of what
//! was sent after a lost connection, and the abort of a Kafka transaction
//! left open.

use pgoutput_decoder::PgTimestamp;
use sink_core::DeliveryErrorKind;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{stopped, Session};
use crate::relay::{
    Deliveries, Destination, ReplicationStream, RunError, Stop, Token, Transactional,
};

impl<D, X, R> Session<'_, D, X, R>
where
    D: Destination<Token>,
    X: Transactional<Token>,
    R: Deliveries<Token>,
{
    /// Waits (until `deadline`, or an immediate shutdown) until every event
    /// of this session that was sent, or waits to be sent, has its report.
    pub(super) async fn drain<S: ReplicationStream>(
        &mut self,
        stream: &mut S,
        shutdown: &mut watch::Receiver<Stop>,
        deadline: Instant,
    ) -> Result<(), RunError> {
        if self.core.exactly_once() {
            // The open transaction was ended before.
            self.core.drop_waiting();
            return Ok(());
        }
        let now = stopped(shutdown, Stop::Now);
        tokio::pin!(now);
        while self.core.unacked_events() > 0 {
            // Held events count as delivered once written.
            self.quarantine_steps(stream, true).await?;
            if self.core.unacked_events() == 0 {
                break;
            }
            self.prepare_front().await?;
            let waiting = self.core.waiting();
            tokio::select! {
                biased;
                report = self.reports.next() => {
                    let report = report.expect("the destination outlives the relay");
                    // Not answered in time (the broker gone): stopping is
                    // what was asked, and what is unconfirmed is sent again
                    // after the restart, as at the drain's deadline.
                    if let Err(e) = &report.result {
                        if e.kind == DeliveryErrorKind::RetriableExhausted {
                            tracing::warn!(
                                unacked = self.core.unacked_events(),
                                error = %e,
                                "the broker did not answer while shutting down: leaving events unconfirmed (they are resent after restart)"
                            );
                            return Ok(());
                        }
                    }
                    let handled = self.core.handle_report(report, Instant::now(), PgTimestamp::now());
                    // Best effort: the final update follows anyway.
                    if let Some(update) = self.carry_out() {
                        let _ = stream.send_status(update).await;
                    }
                    handled?;
                }
                () = &mut now => {
                    tracing::warn!(
                        unacked = self.core.unacked_events(),
                        "second signal: leaving events unconfirmed (they are resent after restart)"
                    );
                    return Ok(());
                }
                permit = self.destination.reserve(waiting.unwrap_or(0)), if waiting.is_some() => {
                    self.send_front(permit).await?;
                }
                () = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(
                        unacked = self.core.unacked_events(),
                        "shutdown timeout: leaving events unconfirmed (they are resent after restart)"
                    );
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// The session lost its stream (Postgres restarted, a connection
    /// broke): the reports of what it sent are still taken, until none is
    /// outstanding or `deadline`, so that each transaction whose every
    /// event the broker acknowledged counts as delivered. The next session
    /// on the same server history skips those when Postgres sends them
    /// again (before Postgres 17 a restart sets the slot back to its last
    /// checkpoint), instead of sending them twice. Nothing is sent and
    /// nothing confirmed meanwhile: the stream is gone. A refusal, or a
    /// report of anything else, leaves its transaction to the next session.
    pub(super) async fn settle(&mut self, deadline: Instant) {
        if self.core.exactly_once() {
            return;
        }
        while self.core.unacked_events() > 0 {
            tokio::select! {
                biased;
                report = self.reports.next() => {
                    let report = report.expect("the destination outlives the relay");
                    let acked = report.result.is_ok();
                    if !acked {
                        return;
                    }
                    let handled = self.core.handle_report(report, Instant::now(), PgTimestamp::now());
                    // The stream is gone: the observations only.
                    self.carry_out();
                    if handled.is_err() {
                        return;
                    }
                }
                () = tokio::time::sleep_until(deadline) => return,
            }
        }
    }

    /// At a session's end: aborts a Kafka transaction left open, so the
    /// next session starts a new one (its events are written again then).
    pub(super) async fn abort_open(&mut self) -> Result<(), RunError> {
        if !self.core.abort_needed() {
            return Ok(());
        }
        let mut attempt = 0;
        loop {
            attempt += 1;
            let result = self.transactions().abort().await;
            let done = self.core.on_aborted(result, attempt);
            self.carry_out();
            if done? {
                return Ok(());
            }
        }
    }

    /// [`Session::abort_open`], given up at `by` or on a second signal (the
    /// transaction is then left open: the next start aborts it).
    pub(super) async fn abort_open_within(
        &mut self,
        shutdown: &watch::Receiver<Stop>,
        by: Option<Instant>,
    ) -> Result<(), RunError> {
        let mut signals = shutdown.clone();
        // After the second signal `by` is the grace left.
        let already_now = *signals.borrow() == Stop::Now;
        let left_open = tokio::select! {
            biased;
            r = self.abort_open() => return r,
            () = stopped(&mut signals, Stop::Now), if !already_now => "a second signal",
            () = tokio::time::sleep_until(by.unwrap_or_else(Instant::now)), if by.is_some() => "the shutdown timeout",
        };
        tracing::warn!("{left_open}: the open Kafka transaction is left to the next start, which aborts it (read_committed consumers wait until then, or the broker's transaction.timeout.ms); nothing is confirmed past the last commit");
        self.core.abandon_transaction();
        Ok(())
    }
}
