//! The slot's confirmed position held behind the receipts: with
//! `receipts = true`, a status update confirms an event only once its
//! receipt is settled (written, or lost and counted). Otherwise a kill -9
//! between the acknowledgement and the receipt's write would leave a
//! delivered, confirmed event without a receipt, and every
//! `walbox.await_delivery` on it would end at its timeout. Only the
//! confirmed position waits: events flow as before.
//!
//! When the core decides a status update, every receipt of the events it
//! confirms has been recorded (observations come before the update), so
//! the update may go out once [`Recorder::settled`] reaches what
//! [`Recorder::recorded`] said then.

use std::collections::VecDeque;

use pgoutput_decoder::{Lsn, StandbyStatusUpdate};

use crate::receipts::Recorder;

/// Held positions at most; past it the newest replaces the last held one
/// (a later target covers an earlier one).
const MOST_HELD: usize = 64;

/// Positions waiting for their receipts.
#[derive(Debug, Default)]
pub(super) struct ReceiptGate {
    /// (receipts recorded when the position was decided, the position),
    /// both increasing.
    held: VecDeque<(u64, Lsn)>,
    /// The highest position whose receipts are settled.
    passed: Option<Lsn>,
    /// The core's latest update, as it decided it.
    latest: Option<StandbyStatusUpdate>,
    /// The confirmed position last let through.
    sent: Lsn,
}

impl ReceiptGate {
    /// `update` with its confirmed position no further than the receipts
    /// allow (the same update without `recorder`). While nothing passed
    /// yet, the position is left out (0: the server confirms nothing).
    pub(super) fn pass(
        &mut self,
        recorder: Option<&Recorder>,
        update: StandbyStatusUpdate,
    ) -> StandbyStatusUpdate {
        let Some(recorder) = recorder else {
            return update;
        };
        let target = recorder.recorded();
        match self.held.back_mut() {
            // No receipt since: the later position waits for the same ones.
            Some(last) if last.0 == target => last.1 = last.1.max(update.flush),
            _ => {
                if self.held.len() == MOST_HELD {
                    self.held.pop_back();
                }
                self.held.push_back((target, update.flush));
            }
        }
        self.latest = Some(update);
        self.advance(recorder.settled());
        let update = self.clamp(update);
        self.sent = self.sent.max(update.flush);
        update
    }

    /// An update to send when receipts settled since the last one let a
    /// held position through; the core, which decided it already, does not
    /// decide it again.
    pub(super) fn release(&mut self, recorder: Option<&Recorder>) -> Option<StandbyStatusUpdate> {
        let (recorder, latest) = (recorder?, self.latest?);
        if self.held.is_empty() {
            return None;
        }
        self.advance(recorder.settled());
        let update = StandbyStatusUpdate {
            reply_requested: false,
            ..self.clamp(latest)
        };
        (update.flush > self.sent).then(|| {
            self.sent = update.flush;
            update
        })
    }

    fn advance(&mut self, settled: u64) {
        while let Some(&(target, lsn)) = self.held.front() {
            if settled < target {
                break;
            }
            self.passed = Some(self.passed.map_or(lsn, |p| p.max(lsn)));
            self.held.pop_front();
        }
    }

    fn clamp(&self, mut update: StandbyStatusUpdate) -> StandbyStatusUpdate {
        let passed = self.passed.unwrap_or(Lsn::ZERO);
        update.flush = update.flush.min(passed);
        update.apply = update.apply.min(passed);
        update
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::receipts::Receipt;

    fn update(lsn: u64) -> StandbyStatusUpdate {
        StandbyStatusUpdate {
            write: Lsn::new(lsn),
            flush: Lsn::new(lsn),
            apply: Lsn::new(lsn),
            client_time: pgoutput_decoder::PgTimestamp::from_pg_micros(0),
            reply_requested: false,
        }
    }

    fn receipt() -> Receipt {
        Receipt {
            event_id: "e".into(),
            topic: "t".into(),
            at: sink_core::Delivered::Kafka {
                partition: 0,
                offset: 0,
            },
            acked_at: std::time::SystemTime::UNIX_EPOCH,
            dead_lettered: false,
        }
    }

    #[tokio::test]
    async fn a_position_is_confirmed_once_its_receipts_are_settled() {
        let (recorder, mut queue) = Recorder::new(Metrics::new());
        let mut gate = ReceiptGate::default();
        // Nothing recorded: it passes.
        assert_eq!(gate.pass(Some(&recorder), update(100)).flush, Lsn::new(100));
        // Two receipts for events up to 200, not written yet: held at 100.
        recorder.record(receipt());
        recorder.record(receipt());
        let held = gate.pass(Some(&recorder), update(200));
        assert_eq!(
            (held.write, held.flush, held.apply),
            (Lsn::new(200), Lsn::new(100), Lsn::new(100))
        );
        // One written: still held; a third receipt for events up to 300.
        queue.recv().await.unwrap();
        recorder.record(receipt());
        assert_eq!(gate.pass(Some(&recorder), update(300)).flush, Lsn::new(100));
        // The second written: 200 passes without a new decision, 300
        // waits for the third.
        queue.recv().await.unwrap();
        let released = gate.release(Some(&recorder)).expect("200 let through");
        assert_eq!(released.flush, Lsn::new(200));
        assert_eq!(gate.release(Some(&recorder)), None, "said once");
        assert_eq!(gate.pass(Some(&recorder), update(300)).flush, Lsn::new(200));
        queue.recv().await.unwrap();
        assert_eq!(gate.pass(Some(&recorder), update(300)).flush, Lsn::new(300));
        // Without receipts, the update as it is.
        assert_eq!(gate.pass(None, update(400)).flush, Lsn::new(400));
    }

    #[tokio::test]
    async fn nothing_is_confirmed_before_the_first_receipts_settle() {
        let (recorder, _queue) = Recorder::new(Metrics::new());
        let mut gate = ReceiptGate::default();
        recorder.record(receipt());
        assert_eq!(gate.pass(Some(&recorder), update(50)).flush, Lsn::ZERO);
    }

    #[tokio::test]
    async fn the_held_positions_are_bounded() {
        let (recorder, mut queue) = Recorder::new(Metrics::new());
        let mut gate = ReceiptGate::default();
        for lsn in 1..=1_000 {
            recorder.record(receipt());
            gate.pass(Some(&recorder), update(lsn));
        }
        assert_eq!(gate.held.len(), MOST_HELD);
        while recorder.settled() < recorder.recorded() {
            queue.recv().await.unwrap();
        }
        assert_eq!(
            gate.pass(Some(&recorder), update(1_000)).flush,
            Lsn::new(1_000)
        );
    }
}
