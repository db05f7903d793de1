//! Deliveries that stopped moving. librdkafka retries a retriable broker
//! answer (`NOT_ENOUGH_REPLICAS`, a leader election, a broker that is down)
//! without end and without a word; walbox keeps the slot before what waits,
//! so nothing is lost, but an operator must hear of it. [`StallWatch`] turns
//! the sink's "how long since the last delivery report" into log lines and
//! readiness: a warning once the stall passes [`STALL_BOUND`] (and again
//! every [`REPEAT`] while it lasts), a line when deliveries resume. Every
//! sink keeps that length itself (sink-core's admission, or Kafka's
//! delivery callbacks): `Destination::stalled_for`.

use std::time::{Duration, Instant};

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
