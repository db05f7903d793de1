//! Which WAL position may be confirmed: the ack tracker.
//!
//! # When the slot may advance
//!
//! A transaction spans Begin(`final_lsn`) … Commit(`commit_lsn`, `end_lsn`);
//! Commit's `commit_lsn` must equal Begin's `final_lsn`, and a Begin inside an
//! open transaction is a protocol error. Each event the transaction produced
//! gets an [`EventToken`]; the broker's acknowledgement of the event is
//! [`AckTracker::ack`]. A transaction is *complete* when it has committed and
//! each of its events has been acked (a transaction without events is complete
//! at its Commit).
//!
//! The confirmable position is the `end_lsn` of the newest transaction such
//! that it and every earlier one are complete. With nothing pending and no
//! transaction open, a keepalive's `wal_end` is confirmable too, which keeps
//! an idle or filtered slot from holding WAL while other tables change. The
//! position never moves backward.
//!
//! ```text
//! commit order:  T1 (end 0/100) ── T2 (end 0/200) ── T3 (end 0/300)
//! events acked:  2/2               1/2               0/0 (no events)
//! confirmable:   0/100  ← T2 waits for its last ack; T3 waits for T2
//! ```
//!
//! Memory is one small entry per transaction not yet confirmable; the relay
//! bounds how many events (and so transactions with events) are in flight.

use std::collections::VecDeque;

use pgoutput_decoder::Lsn;

/// Identifies one event until the broker acknowledged it. Cheap to copy; it is
/// the ack token the Kafka sink carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EventToken {
    tx: u64,
}

/// The stream broke the transaction rules, or a token was acked twice.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AckError {
    /// Begin while a transaction was open.
    #[error(
        "Begin (final LSN {new}) inside the open transaction ending at {open}: protocol error"
    )]
    NestedBegin {
        /// The open transaction's final LSN.
        open: Lsn,
        /// The new Begin's final LSN.
        new: Lsn,
    },
    /// Commit with no open transaction.
    #[error("Commit (commit LSN {0}) without a Begin: protocol error")]
    CommitWithoutBegin(Lsn),
    /// Commit's commit LSN is not the Begin's final LSN.
    #[error(
        "Commit LSN {commit_lsn} does not match Begin's final LSN {final_lsn}: protocol error"
    )]
    CommitMismatch {
        /// From Begin.
        final_lsn: Lsn,
        /// From Commit.
        commit_lsn: Lsn,
    },
    /// An event outside Begin … Commit.
    #[error("an event arrived outside a transaction: protocol error")]
    EventOutsideTransaction,
    /// An ack for a token that is not outstanding (acked twice, or never issued).
    #[error("ack for an event that is not in flight (acked twice?)")]
    UnknownToken,
}

#[derive(Clone, Copy, Debug)]
struct Tx {
    /// Set at Commit.
    end_lsn: Option<Lsn>,
    /// Events issued and not yet acked.
    unacked: u32,
}

/// Tracks transactions and their events' acks; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct AckTracker {
    /// Transactions not yet confirmable, oldest first; the front has
    /// sequence number `front_seq`.
    txs: VecDeque<Tx>,
    front_seq: u64,
    /// The open transaction's final LSN (it is the back of `txs`).
    open: Option<Lsn>,
    confirmable: Lsn,
    unacked_events: u64,
}

impl AckTracker {
    /// Starts at the slot's confirmed position.
    pub fn new(confirmed: Lsn) -> Self {
        AckTracker {
            confirmable: confirmed,
            ..Default::default()
        }
    }

    /// A Begin message.
    pub fn begin(&mut self, final_lsn: Lsn) -> Result<(), AckError> {
        if let Some(open) = self.open {
            return Err(AckError::NestedBegin {
                open,
                new: final_lsn,
            });
        }
        self.txs.push_back(Tx {
            end_lsn: None,
            unacked: 0,
        });
        self.open = Some(final_lsn);
        Ok(())
    }

    /// An event of the open transaction, about to be sent; ack its token when
    /// the broker acknowledged it.
    pub fn event(&mut self) -> Result<EventToken, AckError> {
        if self.open.is_none() {
            return Err(AckError::EventOutsideTransaction);
        }
        let seq = self.front_seq + self.txs.len() as u64 - 1;
        let tx = self
            .txs
            .back_mut()
            .expect("an open transaction is in the queue");
        tx.unacked += 1;
        self.unacked_events += 1;
        Ok(EventToken { tx: seq })
    }

    /// A Commit message. Returns the (possibly advanced) confirmable position.
    pub fn commit(&mut self, commit_lsn: Lsn, end_lsn: Lsn) -> Result<Lsn, AckError> {
        let final_lsn = self.open.ok_or(AckError::CommitWithoutBegin(commit_lsn))?;
        if final_lsn != commit_lsn {
            return Err(AckError::CommitMismatch {
                final_lsn,
                commit_lsn,
            });
        }
        self.open = None;
        self.txs
            .back_mut()
            .expect("an open transaction is in the queue")
            .end_lsn = Some(end_lsn);
        self.advance();
        Ok(self.confirmable)
    }

    /// The broker acknowledged the event. Returns the (possibly advanced)
    /// confirmable position.
    pub fn ack(&mut self, token: EventToken) -> Result<Lsn, AckError> {
        let index = token
            .tx
            .checked_sub(self.front_seq)
            .ok_or(AckError::UnknownToken)?;
        let tx = usize::try_from(index)
            .ok()
            .and_then(|i| self.txs.get_mut(i))
            .ok_or(AckError::UnknownToken)?;
        if tx.unacked == 0 {
            return Err(AckError::UnknownToken);
        }
        tx.unacked -= 1;
        self.unacked_events -= 1;
        self.advance();
        Ok(self.confirmable)
    }

    /// A keepalive's `wal_end`: confirmable when nothing is pending and no
    /// transaction is open. Returns the (possibly advanced) confirmable position.
    pub fn keepalive(&mut self, wal_end: Lsn) -> Lsn {
        if self.open.is_none() && self.txs.is_empty() {
            self.confirmable = self.confirmable.max(wal_end);
        }
        self.confirmable
    }

    /// After a reconnect, the open transaction will never see its Commit (the
    /// server re-sends it from the confirmed position). Its events already
    /// sent may still be acked; it no longer holds back later transactions
    /// beyond those acks, and it never advances the position itself.
    pub fn abandon_open(&mut self) {
        if self.open.take().is_some() {
            // Complete at no position: max() leaves the confirmable one as is.
            self.txs
                .back_mut()
                .expect("an open transaction is in the queue")
                .end_lsn = Some(Lsn::ZERO);
            self.advance();
        }
    }

    /// The newest position that may be confirmed to Postgres.
    pub fn confirmable(&self) -> Lsn {
        self.confirmable
    }

    /// Events sent and not yet acked.
    pub fn unacked_events(&self) -> u64 {
        self.unacked_events
    }

    /// Transactions not yet confirmable (open, committed with unacked events,
    /// or waiting for an earlier one).
    pub fn pending_transactions(&self) -> usize {
        self.txs.len()
    }

    /// True while a transaction is between Begin and Commit.
    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    fn advance(&mut self) {
        while let Some(Tx {
            end_lsn: Some(end),
            unacked: 0,
        }) = self.txs.front().copied()
        {
            debug_assert!(
                end >= self.confirmable || end == Lsn::ZERO,
                "commit order is LSN order"
            );
            self.confirmable = self.confirmable.max(end);
            self.txs.pop_front();
            self.front_seq += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn l(v: u64) -> Lsn {
        Lsn::new(v)
    }

    #[test]
    fn confirms_the_newest_complete_prefix() {
        let mut t = AckTracker::new(l(10));
        t.begin(l(90)).unwrap();
        let a1 = t.event().unwrap();
        let a2 = t.event().unwrap();
        assert_eq!(t.commit(l(90), l(100)).unwrap(), l(10));
        t.begin(l(190)).unwrap();
        let b1 = t.event().unwrap();
        assert_eq!(t.commit(l(190), l(200)).unwrap(), l(10));
        t.begin(l(290)).unwrap();
        assert_eq!(
            t.commit(l(290), l(300)).unwrap(),
            l(10),
            "T3 has no events but waits for T1 and T2"
        );

        assert_eq!(
            t.ack(b1).unwrap(),
            l(10),
            "T2 acked first: still waits for T1"
        );
        assert_eq!(t.ack(a2).unwrap(), l(10));
        assert_eq!(
            t.ack(a1).unwrap(),
            l(300),
            "T1 complete: T1, T2, T3 all confirmable"
        );
        assert_eq!((t.unacked_events(), t.pending_transactions()), (0, 0));
        assert_eq!(
            t.ack(a1),
            Err(AckError::UnknownToken),
            "a double ack is refused"
        );
    }

    #[test]
    fn keepalives_advance_only_when_nothing_is_pending() {
        let mut t = AckTracker::new(l(10));
        assert_eq!(t.keepalive(l(50)), l(50));
        assert_eq!(t.keepalive(l(40)), l(50), "never backward");
        t.begin(l(90)).unwrap();
        assert_eq!(t.keepalive(l(500)), l(50), "a transaction is open");
        let e = t.event().unwrap();
        t.commit(l(90), l(100)).unwrap();
        assert_eq!(t.keepalive(l(500)), l(50), "an event is unacked");
        t.ack(e).unwrap();
        assert_eq!(t.keepalive(l(500)), l(500));
    }

    #[test]
    fn protocol_errors_are_reported() {
        let mut t = AckTracker::new(l(0));
        assert_eq!(t.event(), Err(AckError::EventOutsideTransaction));
        assert_eq!(
            t.commit(l(5), l(6)),
            Err(AckError::CommitWithoutBegin(l(5)))
        );
        t.begin(l(9)).unwrap();
        assert_eq!(
            t.begin(l(19)),
            Err(AckError::NestedBegin {
                open: l(9),
                new: l(19)
            })
        );
        assert_eq!(
            t.commit(l(8), l(10)),
            Err(AckError::CommitMismatch {
                final_lsn: l(9),
                commit_lsn: l(8)
            })
        );
    }

    #[test]
    fn an_abandoned_transaction_does_not_advance_or_block_forever() {
        let mut t = AckTracker::new(l(10));
        t.begin(l(90)).unwrap();
        let e = t.event().unwrap();
        t.abandon_open();
        assert!(!t.in_transaction());
        assert_eq!(t.keepalive(l(1000)), l(10), "its event is still in flight");
        assert_eq!(t.ack(e).unwrap(), l(10), "completing it confirms nothing");
        // The re-sent transaction then confirms normally.
        t.begin(l(90)).unwrap();
        let e = t.event().unwrap();
        t.commit(l(90), l(100)).unwrap();
        assert_eq!(t.ack(e).unwrap(), l(100));
    }

    /// A transaction of the property test: how many events it has.
    fn transactions() -> impl Strategy<Value = (Vec<u8>, Vec<usize>, Vec<bool>)> {
        proptest::collection::vec(0u8..5, 1..30).prop_flat_map(|events| {
            let n: usize = events.iter().map(|e| *e as usize).sum();
            (
                Just(events),
                Just(n).prop_flat_map(|n| Just((0..n).collect::<Vec<_>>()).prop_shuffle()),
                proptest::collection::vec(any::<bool>(), 0..200),
            )
        })
    }

    proptest! {
        /// Whatever order acks arrive in, interleaved with stream messages and
        /// keepalives: the position never moves backward, never passes a
        /// transaction with an unacked event, and ends at the last commit.
        #[test]
        fn never_confirms_past_an_unacked_event((events, ack_order, interleave) in transactions()) {
            let mut t = AckTracker::new(l(1));
            // Stream: transaction i spans final 100i+90, end 100i+100.
            let mut tokens = Vec::new(); // (tx index, token)
            // Acks come in `ack_order`, each once its event was issued.
            let mut remaining = ack_order;
            let mut interleave = interleave.into_iter();
            let mut acked = vec![0u8; events.len()];
            let mut last = t.confirmable();
            let check = |t: &AckTracker, acked: &[u8], last: &mut Lsn, committed: usize| {
                let c = t.confirmable();
                assert!(c >= *last, "moved backward");
                *last = c;
                // Confirming X means every transaction ending at or before X
                // is complete: X stays below the end of the first transaction
                // that is not (committed with an unacked event, or still open).
                let first_incomplete = (0..committed)
                    .find(|&i| acked[i] < events[i])
                    .or_else(|| t.in_transaction().then_some(committed));
                if let Some(fi) = first_incomplete {
                    let end = l(100 * (fi as u64 + 1));
                    assert!(c < end, "confirmed {c}, but transaction {fi} (end {end}) is incomplete");
                }
            };
            for (i, &n) in events.iter().enumerate() {
                let base = 100 * i as u64;
                t.begin(l(base + 90)).unwrap();
                for _ in 0..n {
                    tokens.push((i, t.event().unwrap()));
                }
                // Maybe deliver some acks mid-transaction.
                while interleave.next() == Some(true) {
                    if let Some(pos) = remaining.iter().position(|&k| k < tokens.len()) {
                        let (tx, token) = tokens[remaining.remove(pos)];
                        t.ack(token).unwrap();
                        acked[tx] += 1;
                    }
                }
                t.keepalive(l(base + 95));
                check(&t, &acked, &mut last, i);
                t.commit(l(base + 90), l(base + 100)).unwrap();
                check(&t, &acked, &mut last, i + 1);
                // A keepalive past the commit: confirmable only if all is acked.
                t.keepalive(l(base + 105));
                check(&t, &acked, &mut last, i + 1);
            }
            for k in remaining {
                let (tx, token) = tokens[k];
                t.ack(token).unwrap();
                acked[tx] += 1;
                check(&t, &acked, &mut last, events.len());
            }
            // The last commit, or the keepalive just past it once all was acked.
            let end = 100 * events.len() as u64;
            prop_assert!(t.confirmable() == l(end) || t.confirmable() == l(end + 5), "ended at {}", t.confirmable());
            prop_assert_eq!(t.unacked_events(), 0);
            prop_assert_eq!(t.pending_transactions(), 0);
        }
    }
}
