//! One replication session at a time: the select loop that feeds the
//! [`Core`] its inputs and carries out its effects, the drain on shutdown.
//! Everything that waits is here; everything that decides is in the core.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::LocalBoxFuture;
use futures_util::FutureExt;

use pgoutput_decoder::PgTimestamp;
use tokio::sync::watch;
use tokio::time::Instant;

use super::core::{Core, Effect, EosStartup, SessionStart};
use super::{
    Backoff, Deliveries, Destination, Ends, RelayConfig, ReplicationStream, RunError, Source,
    Started, Stop, Token, Transactional,
};
use crate::metrics::Metrics;

mod coverage;
mod ending;
pub(in crate::relay) mod observe;
mod reading;
mod receipt_gate;
mod sending;
mod upkeep;

pub(super) use coverage::{COVERAGE_INTERVAL, COVERAGE_WHILE_WAITING};
use reading::{Read, READ_BATCH, READ_PAUSE};

/// Exactly-once, shutting down: how long past the shutdown's bound (or
/// after a second signal) a commit under way, or the abort of the open
/// Kafka transaction, may still take. Past it the transaction is left to
/// the next start (which completes or aborts it) or the broker's
/// `transaction.timeout.ms`; nothing is confirmed past the last commit.
pub(super) const END_GRACE: Duration = Duration::from_secs(1);

/// How often the quarantine's requests (`walbox quarantine release`, `drop`)
/// are read, while it is on.
const QUARANTINE_POLL: Duration = Duration::from_secs(1);

/// How often the slot's retained WAL is sampled for the metrics.
const SLOT_SAMPLE_INTERVAL: Duration = Duration::from_secs(10);

/// After this long without a message from the server while walbox reads,
/// status updates ask the server for a reply (a healthy walsender answers
/// at once with a keepalive).
const REPLY_AFTER: Duration = Duration::from_secs(10);

/// While nothing waits for the broker and no transaction is open, status
/// updates ask for a reply this often: the keepalive that answers carries
/// the position the walsender has read the WAL to (other tables' writes
/// included), which walbox then confirms. An idle slot's confirmed position
/// so follows the WAL within a few seconds — what `walbox audit` waits for
/// before it counts a row without a copy as missing, and what
/// `walbox.backlog()` reads — instead of waiting for the walsender's own
/// keepalives, `wal_sender_timeout / 2` apart (30 s by default). It costs
/// one small message each way per second, and no WAL.
const IDLE_REPLY_AFTER: Duration = Duration::from_secs(1);

/// After this long without a message while walbox reads, the connection is
/// presumed dead (a network that drops packets closes nothing) and a new
/// session starts.
pub(super) const RECEIVE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the deliveries of a stream that ended may take to report
/// (the producer's own timeouts end each one well before).
const EXHAUSTED_DRAIN: Duration = Duration::from_secs(3600);

/// How long a session that lost Postgres waits for the reports of what it
/// had sent (see [`Session::settle`]).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the last status update waits for the receipts of what it
/// confirms to be written; past it, it confirms only what they allow.
const RECEIPTS_SETTLE: Duration = Duration::from_secs(5);

/// How long starting a session (connections, checks, START_REPLICATION) may
/// take before it is retried.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// How a session's stream loop ended without an error.
enum Ending {
    /// Shutdown: wait for in-flight deliveries (until `deadline`), confirm.
    Drain { deadline: Instant },
    /// Immediate shutdown: confirm what was acked and go.
    Now,
    /// The stream ended (a backfill's rows are all read): wait for every
    /// delivery, confirm.
    Exhausted,
}

/// The relay's two ends and its core.
pub(super) struct Session<'a, D, X, R> {
    config: &'a RelayConfig,
    destination: &'a D,
    /// In exactly-once mode, the destination's transactions.
    transactions: Option<&'a X>,
    /// What reads the broker back at a start (`skip_delivered`).
    tails: Option<&'a dyn sink_core::tail::TailReader>,
    reports: &'a mut R,
    metrics: Arc<Metrics>,
    core: Core<'a>,
    /// The source's stream ends ([`super::run_once`], a backfill's rows):
    /// its own log lines say what it does, not the slot's.
    ends: bool,
    /// The core asked for the closed Kafka transaction's commit.
    commit_asked: bool,
    /// The confirmed position held behind the receipts' writes.
    receipt_gate: receipt_gate::ReceiptGate,
}

/// Resolves when `shutdown` asks for at least `level`; never if its sender
/// is gone without asking.
pub(super) async fn stopped(shutdown: &mut watch::Receiver<Stop>, level: Stop) {
    if shutdown.wait_for(|stop| *stop >= level).await.is_err() {
        std::future::pending::<()>().await;
    }
}

impl<'a, D, X, R> Session<'a, D, X, R>
where
    D: Destination<Token>,
    X: Transactional<Token>,
    R: Deliveries<Token>,
{
    pub(super) fn new(
        config: &'a RelayConfig,
        ends: Ends<'a, D, X>,
        reports: &'a mut R,
        metrics: Arc<Metrics>,
    ) -> Self {
        assert_eq!(
            config.exactly_once.is_some(),
            ends.transactions.is_some(),
            "exactly-once delivery is given the destination's transactions, and only it"
        );
        Session {
            config,
            destination: ends.destination,
            transactions: ends.transactions,
            tails: ends.tails.filter(|_| config.skip_delivered.is_some()),
            reports,
            metrics,
            core: Core::new(config),
            ends: false,
            commit_asked: false,
            receipt_gate: receipt_gate::ReceiptGate::default(),
        }
    }

    /// A session of a source whose stream ends ([`super::run_once`]).
    pub(super) fn ending(mut self) -> Self {
        self.ends = true;
        self
    }

    /// What the sessions delivered, for [`super::run_once`].
    pub(super) fn finished(&self) -> super::Finished {
        super::Finished {
            dead_lettered: self.core.dead_lettered(),
        }
    }

    /// The destination's transactions: exactly-once mode has them (checked
    /// by [`Session::new`]), and only it reaches here.
    fn transactions(&self) -> &'a X {
        self.transactions
            .expect("exactly-once mode has the destination's transactions")
    }

    /// One session: start streaming, loop, and on the way out either drain
    /// (shutdown) or leave the rest to the next session (transient error).
    pub(super) async fn run<S: Source>(
        &mut self,
        source: &mut S,
        shutdown: &mut watch::Receiver<Stop>,
        backoff: &mut Backoff,
    ) -> Result<(), RunError> {
        let Started {
            mut stream,
            confirmed,
            history,
            server_wal,
            domains,
        } = tokio::select! {
            biased;
            () = stopped(shutdown, Stop::Graceful) => return Ok(()),
            started = tokio::time::timeout(START_TIMEOUT, source.start()) => match started {
                Ok(started) => started?,
                Err(_) => return Err(presumed_dead("starting a session", START_TIMEOUT)),
            },
        };
        backoff.reset();
        self.metrics.set_streaming(true);
        let start = SessionStart {
            confirmed,
            history: &history,
            server_wal,
            domains,
        };
        let startup = self.core.start_session(start);
        self.carry_out();
        if let EosStartup::ReadProgress {
            register,
            topic,
            transactional_id,
        } = startup
        {
            if register {
                self.transactions()
                    .init()
                    .await
                    .map_err(|e| RunError::from_txn(&transactional_id, e))?;
                self.core.on_producer_registered();
            }
            let read = self
                .transactions()
                .last_committed(&topic, &transactional_id)
                .await;
            let read = self.core.on_progress_read(read, server_wal);
            self.carry_out();
            read?;
        }
        if !self.ends {
            tracing::info!(lsn = %confirmed, "streaming from the slot");
        }

        let result = async {
            self.check_coverage(&mut stream).await?;
            // What is held, before the first event.
            self.quarantine_steps(&mut stream, false).await?;
            self.stream(&mut stream, shutdown).await
        }
        .await;
        // Exactly-once: what was sent in a transaction that did not commit
        // is discarded, and written again by the next session.
        let abort_by = match &result {
            Ok(Ending::Drain { deadline }) => Some((*deadline).max(Instant::now()) + END_GRACE),
            Ok(Ending::Now) => Some(Instant::now() + END_GRACE),
            _ => None,
        };
        let aborted = self.abort_open_within(shutdown, abort_by).await;
        // What the session's end decided is said before it returns.
        self.carry_out();
        let result = match (result, aborted) {
            (Ok(ending), Ok(())) => Ok(ending),
            (Err(e), Ok(())) | (Ok(_), Err(e)) => Err(e),
            // A producer that could not abort cannot start the next
            // session's transaction: that outranks a transient error.
            (Err(e), Err(abort)) if e.is_transient() => Err(abort),
            (Err(e), Err(_)) => Err(e),
        };
        match result {
            Ok(ending) => {
                let deadline = match ending {
                    Ending::Drain { deadline } => Some(deadline),
                    Ending::Exhausted => Some(Instant::now() + EXHAUSTED_DRAIN),
                    Ending::Now => None,
                };
                if let Some(deadline) = deadline {
                    self.drain(&mut stream, shutdown, deadline).await?;
                    self.verify_coverage_now(&mut stream).await?;
                }
                let update = self.final_update().await;
                match stream.send_status(update).await {
                    Ok(()) if self.ends => {}
                    Ok(()) => tracing::info!(lsn = %update.flush, "confirmed on shutdown"),
                    Err(e) => tracing::warn!(error = %e, "could not send the final status update"),
                }
                stream.close().await;
                Ok(())
            }
            Err(e) if e.is_transient() => {
                self.settle(Instant::now() + SETTLE_TIMEOUT).await;
                Err(e)
            }
            Err(e) => {
                // Confirm what is safely delivered (and covered) before
                // stopping; after drift, only what was verified before it.
                if !matches!(e, RunError::Drift(_)) {
                    let _ = self.verify_coverage_now(&mut stream).await;
                }
                let update = self.final_update().await;
                let _ = stream.send_status(update).await;
                Err(e)
            }
        }
    }

    /// Carries out what the core decided: observations written, the commit
    /// asked for noted ([`Session::commit_asked`]); returns the latest
    /// status update (each carries every position so far).
    pub(super) fn carry_out(&mut self) -> Option<pgoutput_decoder::StandbyStatusUpdate> {
        let mut status = None;
        while let Some(effect) = self.core.poll_effect() {
            match effect {
                Effect::Status(update) => status = Some(update),
                Effect::Commit => self.commit_asked = true,
                Effect::Observe(o) => observe::observe(self.config, &self.metrics, o),
            }
        }
        let receipts = self.config.receipts.as_ref();
        match status {
            Some(update) => Some(self.receipt_gate.pass(receipts, update)),
            None => self.receipt_gate.release(receipts),
        }
    }

    /// The core's last status update, once what it confirms has its
    /// receipts settled (waiting for them up to [`RECEIPTS_SETTLE`]).
    async fn final_update(&mut self) -> pgoutput_decoder::StandbyStatusUpdate {
        if let Some(recorder) = &self.config.receipts {
            recorder.settle(Instant::now() + RECEIPTS_SETTLE).await;
        }
        let update = self.core.final_update(Instant::now());
        self.receipt_gate
            .pass(self.config.receipts.as_ref(), update)
    }

    /// [`Session::carry_out`], and the status update sent.
    pub(super) async fn effects<S: ReplicationStream>(
        &mut self,
        stream: &mut S,
    ) -> Result<(), RunError> {
        let update = self.carry_out();
        send_status(stream, update).await
    }

    /// The select loop, until shutdown or an error. On a graceful shutdown
    /// inside a transaction, the rest of the transaction is read first (until
    /// the shutdown deadline), so a restart re-sends nothing of it.
    async fn stream<S: ReplicationStream>(
        &mut self,
        stream: &mut S,
        shutdown: &mut watch::Receiver<Stop>,
    ) -> Result<Ending, RunError> {
        // The timers live across iterations and are reset only when their
        // deadline moves. A fresh `sleep_until` per iteration registers with
        // the runtime's timer wheel every time, and from this thread that
        // wakes the driver thread: once per message, ~17% of walbox's CPU in
        // a backlog drain.
        let sample = tokio::time::sleep_until(Instant::now());
        tokio::pin!(sample);
        // What the core asked to be woken for (`Core::poll_timeout`).
        let core_due = tokio::time::sleep_until(Instant::now());
        tokio::pin!(core_due);
        let mut coverage_read = Instant::now();
        let coverage_due = tokio::time::sleep_until(coverage_read + COVERAGE_INTERVAL);
        tokio::pin!(coverage_due);
        // Set once a graceful shutdown was asked for: its deadline.
        let mut finishing: Option<Instant> = None;
        let finish_by = tokio::time::sleep_until(Instant::now());
        tokio::pin!(finish_by);
        // One future per shutdown level for the whole session: a fresh one
        // per iteration would register and deregister a waiter (two mutex
        // round trips) per message.
        let mut now_rx = shutdown.clone();
        let stop = stopped(shutdown, Stop::Graceful);
        tokio::pin!(stop);
        let now = stopped(&mut now_rx, Stop::Now);
        tokio::pin!(now);
        // The last time a message arrived, or walbox was not reading (room
        // for records is what it waited for then, not the server).
        let mut heard = Instant::now();
        let silence = tokio::time::sleep_until(heard + RECEIVE_TIMEOUT);
        tokio::pin!(silence);
        // Exactly-once: the commit of the closed Kafka transaction (its
        // time bound is the core's, in `core_due`).
        let destination = self.destination;
        let transactions = self.transactions;
        let mut committing: Option<LocalBoxFuture<'_, Result<(), sink_core::TxnError>>> = None;
        // The quarantine's requests are read this often.
        let held_poll = tokio::time::sleep_until(Instant::now() + QUARANTINE_POLL);
        tokio::pin!(held_poll);
        let quarantines = self.core.quarantines();
        // Reading paused while draining a backlog (see `Core::behind`).
        let mut pausing = false;
        let pause = tokio::time::sleep_until(Instant::now());
        tokio::pin!(pause);
        let result = loop {
            if let Some(deadline) = finishing {
                if !self.core.in_transaction() && self.core.transaction_idle() {
                    break Ok(Ending::Drain { deadline });
                }
            }
            if self.core.exactly_once() {
                let upkeep =
                    self.core
                        .upkeep(Instant::now(), finishing.is_some(), destination.in_flight());
                if let Err(e) = upkeep {
                    break Err(e);
                }
            }
            if let Err(e) = self.effects(stream).await {
                break Err(e);
            }
            if std::mem::take(&mut self.commit_asked) {
                if let Some(transactions) = transactions {
                    committing = Some(transactions.commit().boxed_local());
                }
            }
            let busy = self.core.transaction_busy();
            let sending = !self.core.commit_under_way();
            observe::gauges(
                &self.metrics,
                self.core.positions(),
                destination.in_flight(),
                destination.in_flight_bytes(),
            );
            let due = coverage_read
                + if self.core.awaiting_coverage() {
                    COVERAGE_WHILE_WAITING
                } else {
                    COVERAGE_INTERVAL
                };
            if coverage_due.deadline() != due {
                coverage_due.as_mut().reset(due);
            }
            // A value is serialized, and an oversized one stored, before
            // the record is sent.
            if let Err(e) = self.prepare_front().await {
                break Err(e);
            }
            let due = self.core.poll_timeout().unwrap_or_else(Instant::now);
            if core_due.deadline() != due {
                core_due.as_mut().reset(due);
            }
            let waiting = self.core.waiting();
            if waiting.is_some() || busy {
                heard = Instant::now();
            }
            if silence.deadline() != heard + RECEIVE_TIMEOUT {
                silence.as_mut().reset(heard + RECEIVE_TIMEOUT);
            }
            let step: Result<(), RunError> = tokio::select! {
                biased;
                report = self.reports.next() => {
                    let batch = !self.core.exactly_once();
                    let handled = self.on_reports(report.expect("the destination outlives the relay"), batch);
                    self.effects(stream).await.and(handled)
                }
                committed = async { committing.as_mut().expect("guarded").await }, if committing.is_some() => {
                    committing = None;
                    let handled = self.core.on_committed(committed, Instant::now(), PgTimestamp::now());
                    self.effects(stream).await.and(handled)
                }
                () = &mut now => break Ok(Ending::Now),
                () = &mut stop, if finishing.is_none() => {
                    let deadline = Instant::now() + self.config.shutdown_timeout;
                    if self.core.in_transaction() {
                        tracing::info!("shutting down: reading the rest of the open transaction first");
                    }
                    finish_by.as_mut().reset(deadline);
                    finishing = Some(deadline);
                    Ok(())
                }
                () = &mut finish_by, if finishing.is_some() => {
                    if self.core.in_transaction() {
                        tracing::warn!("shutdown timeout inside a transaction: its events are sent again after restart");
                    } else {
                        tracing::warn!("shutdown timeout before the open Kafka transaction committed: its events are sent again after restart");
                    }
                    break Ok(Ending::Drain { deadline: Instant::now() });
                }
                () = &mut core_due => {
                    let idle = self.core.unacked_events() == 0 && !self.core.in_transaction();
                    let quiet = heard.elapsed();
                    let ask = quiet >= REPLY_AFTER || (idle && quiet >= IDLE_REPLY_AFTER);
                    self.core.handle_timeout(Instant::now(), ask);
                    self.effects(stream).await
                }
                () = &mut coverage_due => {
                    coverage_read = Instant::now();
                    self.check_coverage(stream).await
                }
                () = &mut sample => {
                    let next = sample.deadline() + SLOT_SAMPLE_INTERVAL;
                    sample.as_mut().reset(next);
                    if let Some(slot) = stream.slot_sample().await {
                        self.metrics.set_slot(&slot);
                    }
                    self.save_position(stream).await;
                    Ok(())
                }
                permit = self.destination.reserve(waiting.unwrap_or(0)), if waiting.is_some() && sending => {
                    // A send can wait (the first record of a topic is
                    // checked against the brokers): a second signal cuts it.
                    tokio::select! {
                        biased;
                        sent = self.send_front(permit) => sent,
                        () = &mut now => break Ok(Ending::Now),
                    }
                }
                // Read only while nothing waits for room: memory stays within
                // the in-flight bounds plus one record.
                message = stream.next(), if waiting.is_none() && !busy && !pausing => {
                    heard = Instant::now();
                    // Not shutting down: the messages already received
                    // follow in this turn (see `READ_BATCH`).
                    let batch = if finishing.is_none() { READ_BATCH } else { 1 };
                    match self.on_messages(stream, message.map_err(RunError::from), batch).await {
                        Ok(Read::Empty) if batch > 1 && self.core.behind(PgTimestamp::now()) => {
                            pausing = true;
                            pause.as_mut().reset(Instant::now() + READ_PAUSE);
                            Ok(())
                        }
                        Ok(Read::End) => break Ok(Ending::Exhausted),
                        other => other.map(|_| ()),
                    }
                }
                () = &mut pause, if pausing => {
                    pausing = false;
                    Ok(())
                }
                () = &mut held_poll, if quarantines => {
                    held_poll.as_mut().reset(Instant::now() + QUARANTINE_POLL);
                    self.core.quarantine_poll();
                    Ok(())
                }
                // After the stream's branch: what is already received is read first.
                () = &mut silence, if waiting.is_none() && !busy => {
                    Err(presumed_dead("the replication connection", RECEIVE_TIMEOUT))
                }
            };
            // Held events are written before anything else: until then
            // their transactions cannot be confirmed.
            let step = match step {
                Ok(()) if quarantines => self.quarantine_steps(stream, finishing.is_some()).await,
                other => other,
            };
            if let Err(e) = step {
                break Err(e);
            }
        };
        // A commit under way finishes first (bounded by its timeout, and
        // when shutting down by the shutdown's bound and a second signal):
        // its outcome decides what the abort at the session's end undoes.
        if let Some(commit) = committing.take() {
            let cut = match (&result, finishing) {
                (Ok(Ending::Now), _) => Some(Instant::now()),
                (_, Some(deadline)) => Some(deadline.max(Instant::now()) + END_GRACE),
                _ => None,
            };
            // `now` already ended the loop when the ending is Now.
            let signalled = matches!(result, Ok(Ending::Now));
            let outcome = tokio::select! {
                biased;
                outcome = commit => Some(outcome),
                () = &mut now, if !signalled => None,
                () = tokio::time::sleep_until(cut.unwrap_or_else(Instant::now)), if cut.is_some() => None,
            };
            match outcome {
                Some(outcome) => {
                    let handled =
                        self.core
                            .on_committed(outcome, Instant::now(), PgTimestamp::now());
                    // Best effort: what committed is confirmed at the end.
                    let update = self.carry_out();
                    if let (Ok(()), Some(update)) = (handled, update) {
                        let _ = stream.send_status(update).await;
                    }
                }
                None => {
                    tracing::warn!("shutting down before the Kafka transaction's commit finished: the next start completes or aborts it; nothing is confirmed past the last commit");
                    self.core.abandon_transaction();
                    return Ok(Ending::Now);
                }
            }
        }
        result
    }
}

/// A transient error for a connection that stopped answering.
fn presumed_dead(what: &str, after: Duration) -> RunError {
    RunError::TimedOut {
        what: what.to_owned(),
        after,
    }
}

async fn send_status<S: ReplicationStream>(
    stream: &mut S,
    update: Option<pgoutput_decoder::StandbyStatusUpdate>,
) -> Result<(), RunError> {
    match update {
        Some(update) => Ok(stream.send_status(update).await?),
        None => Ok(()),
    }
}
