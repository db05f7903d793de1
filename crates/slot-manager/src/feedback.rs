//! LSN feedback: what the standby status updates report.
//!
//! # When the slot may advance
//!
//! `flush` (and `apply`) in a status update move the slot's
//! `confirmed_flush_lsn`; Postgres may then recycle WAL before it. So `flush`
//! is only ever a position the caller [confirmed](Feedback::confirm): the end
//! of a transaction whose events, and those of every earlier transaction, the
//! broker acknowledged; or, with nothing pending, a keepalive's `wal_end`.
//! Neither position moves backward. `write` reports what was received.
//!
//! An update is due at least every status interval (keep it below
//! `wal_sender_timeout / 2`), and at once when a keepalive asks for a reply.

use std::time::{Duration, Instant};

use pgoutput_decoder::{Lsn, PgTimestamp, StandbyStatusUpdate};

/// The default status interval.
pub const DEFAULT_STATUS_INTERVAL: Duration = Duration::from_secs(1);

/// Tracks received and confirmed positions and decides when to report them.
#[derive(Clone, Debug)]
pub struct Feedback {
    received: Lsn,
    confirmed: Lsn,
    interval: Duration,
    eager_gap: Duration,
    last_sent: Option<Instant>,
    last_sent_flush: Lsn,
}

impl Feedback {
    /// Starts from the slot's confirmed position.
    pub fn new(confirmed: Lsn, interval: Duration) -> Feedback {
        Feedback {
            received: confirmed,
            confirmed,
            interval,
            eager_gap: Duration::ZERO,
            last_sent: None,
            last_sent_flush: confirmed,
        }
    }

    /// Spaces eager updates (see [`Feedback::poll_update`]) at least `gap`
    /// apart, so a stream of acknowledgements does not become a stream of
    /// status updates.
    pub fn with_eager_gap(mut self, gap: Duration) -> Feedback {
        self.eager_gap = gap;
        self
    }

    /// Records WAL received up to `lsn` (an XLogData's or keepalive's `wal_end`).
    pub fn received(&mut self, lsn: Lsn) {
        self.received = self.received.max(lsn);
    }

    /// Confirms that everything up to `lsn` is durably processed. A position
    /// at or behind the current one is ignored: confirmations never move back.
    pub fn confirm(&mut self, lsn: Lsn) {
        self.confirmed = self.confirmed.max(lsn);
        self.received = self.received.max(self.confirmed);
    }

    /// The highest confirmed position.
    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// The highest received position.
    pub fn last_received(&self) -> Lsn {
        self.received
    }

    /// When the next update is due: the periodic one or, with an eager gap
    /// set, sooner if a confirmation is being held back by the gap (at the
    /// gap's end), so that the last acknowledgement of a burst is reported
    /// within the gap, not a whole interval later. Call
    /// `poll_update(now, false, true)` when it is reached.
    pub fn next_due(&self) -> Instant {
        let Some(last) = self.last_sent else {
            return Instant::now();
        };
        if !self.eager_gap.is_zero() && self.confirmed > self.last_sent_flush {
            last + self.eager_gap.min(self.interval)
        } else {
            last + self.interval
        }
    }

    /// The update to send now, if one is due at `now`: periodically, when a
    /// keepalive requested a reply, or, with `eager`, when the confirmed
    /// position moved (at most once per eager gap). Marks it as sent.
    pub fn poll_update(
        &mut self,
        now: Instant,
        reply_requested: bool,
        eager: bool,
    ) -> Option<StandbyStatusUpdate> {
        let periodic = self.last_sent.is_none_or(|t| now >= t + self.interval);
        let moved = eager
            && self.confirmed > self.last_sent_flush
            && self.last_sent.is_none_or(|t| now >= t + self.eager_gap);
        if !(periodic || reply_requested || moved) {
            return None;
        }
        self.last_sent = Some(now);
        self.last_sent_flush = self.confirmed;
        Some(self.update(false))
    }

    /// The update reporting the current positions.
    pub fn update(&self, reply_requested: bool) -> StandbyStatusUpdate {
        StandbyStatusUpdate {
            write: self.received,
            flush: self.confirmed,
            apply: self.confirmed,
            client_time: PgTimestamp::now(),
            reply_requested,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_never_move_backward() {
        let mut f = Feedback::new(Lsn::new(100), DEFAULT_STATUS_INTERVAL);
        f.confirm(Lsn::new(50));
        assert_eq!(f.confirmed(), Lsn::new(100));
        f.received(Lsn::new(300));
        f.received(Lsn::new(200));
        f.confirm(Lsn::new(250));
        let u = f.update(false);
        assert_eq!(
            (u.write, u.flush, u.apply),
            (Lsn::new(300), Lsn::new(250), Lsn::new(250))
        );
        f.confirm(Lsn::new(400));
        assert_eq!(
            f.update(false).write,
            Lsn::new(400),
            "write is never behind flush"
        );
    }

    #[test]
    fn updates_are_periodic_on_request_or_eager() {
        let t0 = Instant::now();
        let mut f = Feedback::new(Lsn::new(1), Duration::from_secs(1));
        assert!(
            f.poll_update(t0, false, false).is_some(),
            "the first is due at once"
        );
        assert!(f
            .poll_update(t0 + Duration::from_millis(500), false, false)
            .is_none());
        assert!(
            f.poll_update(t0 + Duration::from_millis(500), true, false)
                .is_some(),
            "reply requested"
        );
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!(f.next_due(), t1 + Duration::from_secs(1));
        f.confirm(Lsn::new(2));
        assert!(f
            .poll_update(t1 + Duration::from_millis(1), false, false)
            .is_none());
        assert_eq!(
            f.poll_update(t1 + Duration::from_millis(1), false, true)
                .unwrap()
                .flush,
            Lsn::new(2)
        );
        assert!(
            f.poll_update(t1 + Duration::from_millis(2), false, true)
                .is_none(),
            "nothing new to confirm"
        );
        assert!(f
            .poll_update(t1 + Duration::from_secs(2), false, false)
            .is_some());
    }

    #[test]
    fn eager_updates_respect_the_gap() {
        let t0 = Instant::now();
        let mut f = Feedback::new(Lsn::new(1), Duration::from_secs(1))
            .with_eager_gap(Duration::from_millis(100));
        assert!(f.poll_update(t0, false, false).is_some());
        f.confirm(Lsn::new(2));
        assert!(
            f.poll_update(t0 + Duration::from_millis(50), false, true)
                .is_none(),
            "too soon"
        );
        assert_eq!(
            f.next_due(),
            t0 + Duration::from_millis(100),
            "the held-back confirmation is due at the gap's end, not the interval's"
        );
        assert_eq!(
            f.poll_update(t0 + Duration::from_millis(100), false, true)
                .unwrap()
                .flush,
            Lsn::new(2)
        );
        assert_eq!(
            f.next_due(),
            t0 + Duration::from_millis(1100),
            "nothing held back: the periodic update is next"
        );
    }
}
