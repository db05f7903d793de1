//! Deliveries that stopped moving. librdkafka retries a retriable broker
//! answer (`NOT_ENOUGH_REPLICAS`, a leader election, a broker that is down)
//! without end and without a word; walbox keeps the slot before what waits,
//! so nothing is lost, but an operator must hear of it. [`StallWatch`] turns
//! the sink's "how long since the last delivery report" into log lines and
//! readiness: a warning once the stall passes [`STALL_BOUND`] (and again
//! every [`REPEAT`] while it lasts), a line when deliveries resume. Kafka's
//! sink keeps that length itself; for the other brokers a [`StallClock`]
//! keeps it from the records sent and the reports received.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long records have waited without any report, kept from what is
/// sent and reported (the sinks of RabbitMQ and SQS keep no such clock).
#[derive(Debug)]
pub struct StallClock {
    origin: Instant,
    waiting: AtomicUsize,
    /// Milliseconds from `origin` to the last report, or to the send that
    /// ended a time with nothing waiting.
    moved_ms: AtomicU64,
}

impl Default for StallClock {
    fn default() -> Self {
        StallClock {
            origin: Instant::now(),
            waiting: AtomicUsize::new(0),
            moved_ms: AtomicU64::new(0),
        }
    }
}

impl StallClock {
    /// A record was sent.
    pub fn sent(&self) {
        if self.waiting.fetch_add(1, Ordering::Relaxed) == 0 {
            self.stamp();
        }
    }

    /// A record's report arrived.
    pub fn reported(&self) {
        let _ = self
            .waiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        self.stamp();
    }

    /// Records waiting for their report.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// How long records have waited without any report (zero when none
    /// waits).
    pub fn stalled_for(&self) -> Duration {
        if self.waiting() == 0 {
            return Duration::ZERO;
        }
        let moved = Duration::from_millis(self.moved_ms.load(Ordering::Relaxed));
        self.origin.elapsed().saturating_sub(moved)
    }

    fn stamp(&self) {
        let ms = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.moved_ms.store(ms, Ordering::Relaxed);
    }
}

/// Deliveries waiting this long without any report count as stalled.
pub const STALL_BOUND: Duration = Duration::from_secs(30);
/// While stalled, the warning is repeated this often.
pub const REPEAT: Duration = Duration::from_secs(60);

/// What an observation calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StallEvent {
    /// Stalled for this long: warn (first time, or again after [`REPEAT`]).
    Stalled(Duration),
    /// Moving again after a stall that lasted at least this long.
    Resumed(Duration),
}

/// Follows one sink's stall, observation by observation.
#[derive(Debug, Default)]
pub struct StallWatch {
    /// When the current stall was last reported, and its longest length.
    reported: Option<(Instant, Duration)>,
}

impl StallWatch {
    /// Takes the sink's current stall length at `now`.
    pub fn observe(&mut self, stalled_for: Duration, now: Instant) -> Option<StallEvent> {
        if stalled_for < STALL_BOUND {
            return self
                .reported
                .take()
                .map(|(_, longest)| StallEvent::Resumed(longest));
        }
        match &mut self.reported {
            Some((at, longest)) => {
                *longest = (*longest).max(stalled_for);
                if now.duration_since(*at) >= REPEAT {
                    *at = now;
                    Some(StallEvent::Stalled(stalled_for))
                } else {
                    None
                }
            }
            None => {
                self.reported = Some((now, stalled_for));
                Some(StallEvent::Stalled(stalled_for))
            }
        }
    }

    /// True while a stall is being reported (readiness says so).
    pub fn is_stalled(&self) -> bool {
        self.reported.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_runs_while_records_wait_without_reports() {
        let c = StallClock::default();
        assert_eq!(c.stalled_for(), Duration::ZERO);
        c.sent();
        c.sent();
        std::thread::sleep(Duration::from_millis(30));
        assert!(c.stalled_for() >= Duration::from_millis(30));
        c.reported();
        assert!(
            c.stalled_for() < Duration::from_millis(30),
            "a report moves it"
        );
        assert_eq!(c.waiting(), 1);
        c.reported();
        std::thread::sleep(Duration::from_millis(10));
        assert_eq!(c.stalled_for(), Duration::ZERO, "nothing waits");
        c.reported();
        assert_eq!(c.waiting(), 0, "never below zero");
    }

    #[test]
    fn warns_past_the_bound_repeats_and_says_when_it_resumes() {
        let t0 = Instant::now();
        let s = |secs| Duration::from_secs(secs);
        let mut w = StallWatch::default();
        assert_eq!(w.observe(s(0), t0), None);
        assert_eq!(w.observe(s(29), t0 + s(29)), None);
        assert!(!w.is_stalled());
        assert_eq!(
            w.observe(s(30), t0 + s(30)),
            Some(StallEvent::Stalled(s(30)))
        );
        assert!(w.is_stalled());
        assert_eq!(w.observe(s(31), t0 + s(31)), None, "once, not every second");
        assert_eq!(
            w.observe(s(90), t0 + s(90)),
            Some(StallEvent::Stalled(s(90)))
        );
        assert_eq!(w.observe(s(100), t0 + s(100)), None);
        assert_eq!(
            w.observe(s(0), t0 + s(101)),
            Some(StallEvent::Resumed(s(100)))
        );
        assert!(!w.is_stalled());
        assert_eq!(w.observe(s(0), t0 + s(102)), None);
    }
}
