//! Reading the stream and the reports: received messages and waiting
//! reports are handled in batches, so that one turn of the select loop
//! serves many.

use std::time::Duration;

use futures_util::FutureExt;
use pgoutput_decoder::PgTimestamp;
use tokio::time::Instant;

use super::Session;
use crate::relay::{
    Deliveries, Destination, Input, ReplicationStream, RunError, Token, Transactional,
};

/// At most this many received messages are handled in one turn of the
/// select loop: bounded so that reports, timers and signals wait for no
/// more than a few hundred microseconds. (Exactly-once: a turn also ends
/// when the open Kafka transaction is full.)
pub(super) const READ_BATCH: usize = 128;
/// How long reading pauses when the received messages ran out while
/// walbox is behind (see [`Core::behind`]): the timer's resolution.
pub(super) const READ_PAUSE: Duration = Duration::from_millis(1);

/// How a turn of reading ended.
pub(super) enum Read {
    /// Nothing more was received yet.
    Empty,
    /// The batch was full, records wait for room, or the Kafka
    /// transaction is full.
    Full,
    /// The stream ended ([`Input::End`]).
    End,
}

impl<D, X, R> Session<'_, D, X, R>
where
    D: Destination<Token>,
    X: Transactional<Token>,
    R: Deliveries<Token>,
{
    /// Handles `first` and then up to `batch - 1` more inputs that can be
    /// read without waiting, while each one's records found room at once.
    /// A turn of the select loop polls every branch, registers wakers and
    /// reads the clock: once per message it was about a third of walbox's
    /// CPU in a backlog drain.
    pub(super) async fn on_messages<S: ReplicationStream>(
        &mut self,
        stream: &mut S,
        first: Result<Input, RunError>,
        batch: usize,
    ) -> Result<Read, RunError> {
        // One clock reading for the batch: its messages are read without
        // waiting on the stream.
        let (now, wall) = (Instant::now(), PgTimestamp::now());
        let mut message = first;
        let mut read = 1;
        loop {
            let input = message?;
            if let Input::End = input {
                return Ok(Read::End);
            }
            let handled = self.core.handle_input(input, now, wall);
            self.effects(stream).await?;
            handled?;
            self.send_while_room().await?;
            if read == batch || self.core.waiting().is_some() || self.core.transaction_full() {
                return Ok(Read::Full);
            }
            read += 1;
            match stream.next().now_or_never() {
                Some(next) => message = next.map_err(RunError::from),
                None => return Ok(Read::Empty),
            }
        }
    }

    /// Handles `first` and, when `batch`, every report already waiting.
    pub(super) fn on_reports(
        &mut self,
        first: sink_core::Report<super::Token>,
        batch: bool,
    ) -> Result<(), RunError> {
        // One reading of the clocks for the reports at hand: they arrived
        // within microseconds of each other.
        let (now, wall) = (Instant::now(), PgTimestamp::now());
        self.core.handle_report(first, now, wall)?;
        if batch {
            while let Some(Some(report)) = self.reports.next().now_or_never() {
                self.core.handle_report(report, now, wall)?;
            }
        }
        Ok(())
    }
}
