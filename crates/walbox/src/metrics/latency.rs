//! Exact latencies: every event's, in an HDR histogram (three significant
//! digits), for the percentiles walbox logs when it stops. Commit to ack is
//! what users feel (the Prometheus histogram beside it has bucket bounds
//! only); commit to read, the part of it spent before walbox had the event
//! (the commit's WAL flush, decoding, the walsender's send, walbox waiting
//! for a core to read), tells the rest (walbox, the producer, the broker)
//! from it.

use std::sync::Mutex;

use hdrhistogram::Histogram;

/// Latencies above this (µs, ten minutes) are recorded as this.
const HIGHEST_MICROS: u64 = 600_000_000;

/// Every event's latency (of one kind) since walbox started.
#[derive(Debug)]
pub struct ExactLatency {
    micros: Mutex<Histogram<u32>>,
}

impl Default for ExactLatency {
    fn default() -> Self {
        ExactLatency {
            micros: Mutex::new(
                Histogram::new_with_bounds(1, HIGHEST_MICROS, 3).expect("valid bounds"),
            ),
        }
    }
}

impl ExactLatency {
    /// Records one event's latency (negative ones, a clock step, as 0).
    pub fn record(&self, micros: i64) {
        self.record_n(micros, 1);
    }

    /// Records the same latency for `events` events.
    pub fn record_n(&self, micros: i64, events: u64) {
        if events == 0 {
            return;
        }
        let micros = u64::try_from(micros).unwrap_or(0).max(1);
        if let Ok(mut h) = self.micros.lock() {
            h.saturating_record_n(micros, u32::try_from(events).unwrap_or(u32::MAX));
        }
    }

    /// `events`, p50, p99, p99.9 and max in milliseconds; `None` before the
    /// first event.
    pub fn summary(&self) -> Option<LatencySummary> {
        let h = self.micros.lock().ok()?;
        if h.is_empty() {
            return None;
        }
        let ms = |micros: u64| micros as f64 / 1000.0;
        Some(LatencySummary {
            events: h.len(),
            p50_ms: ms(h.value_at_quantile(0.5)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            p999_ms: ms(h.value_at_quantile(0.999)),
            max_ms: ms(h.max()),
        })
    }
}

/// Percentiles of the exact latencies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatencySummary {
    /// Events recorded.
    pub events: u64,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_exact_to_three_digits() {
        let l = ExactLatency::default();
        assert_eq!(l.summary(), None);
        // 1..=1000 ms, one event each.
        for ms in 1..=1000 {
            l.record(ms * 1000);
        }
        l.record(-5);
        let s = l.summary().unwrap();
        assert_eq!(s.events, 1001);
        assert!((s.p50_ms - 500.0).abs() <= 0.5, "{s:?}");
        assert!((s.p99_ms - 990.0).abs() <= 1.0, "{s:?}");
        assert!((s.max_ms - 1000.0).abs() <= 1.0, "{s:?}");
        // Beyond the highest trackable value: clamped, not lost.
        l.record(i64::MAX);
        assert_eq!(l.summary().unwrap().events, 1002);
    }

    #[test]
    fn a_transaction_counts_once_per_event() {
        let l = ExactLatency::default();
        l.record_n(2_000, 0);
        assert_eq!(l.summary(), None);
        // 99 transactions of one event at 1 ms, one of 10 events at 50 ms:
        // 10 of 109 events waited 50 ms, so the p99 is 50 ms.
        for _ in 0..99 {
            l.record_n(1_000, 1);
        }
        l.record_n(50_000, 10);
        let s = l.summary().unwrap();
        assert_eq!(s.events, 109);
        assert!((s.p50_ms - 1.0).abs() <= 0.01, "{s:?}");
        assert!((s.p99_ms - 50.0).abs() <= 0.05, "{s:?}");
        l.record_n(i64::MAX, 3);
        assert_eq!(l.summary().unwrap().events, 112);
    }
}
