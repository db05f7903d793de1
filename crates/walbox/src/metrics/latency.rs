//! Exact latencies: every event's, in an HDR histogram (three significant
//! digits), for the percentiles walbox logs when it stops. Commit to ack is
//! what users feel (the Prometheus histogram beside it has bucket bounds
//! only); commit to read, the part of it spent before walbox had the event
//! (the commit's WAL flush, decoding, the walsender's send, walbox waiting
//! for a core to read), tells the rest (walbox, the producer, the broker)
//! from it; [`SplitLatency`] splits the rest into walbox's own part and the
//! broker client's.

use std::sync::Mutex;

use hdrhistogram::Histogram;

/// Latencies above this (µs, ten minutes) are recorded as this.
const HIGHEST_MICROS: u64 = 600_000_000;

/// One kind of latency, every event's (µs, three significant digits).
#[derive(Debug)]
struct Exact(Histogram<u32>);

impl Default for Exact {
    fn default() -> Self {
        Exact(Histogram::new_with_bounds(1, HIGHEST_MICROS, 3).expect("valid bounds"))
    }
}

impl Exact {
    fn record_n(&mut self, micros: u64, events: u64) {
        if events > 0 {
            let events = u32::try_from(events).unwrap_or(u32::MAX);
            self.0.saturating_record_n(micros.max(1), events);
        }
    }

    fn summary(&self) -> Option<LatencySummary> {
        let h = &self.0;
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

/// Every event's latency (of one kind) since walbox started.
#[derive(Debug, Default)]
pub struct ExactLatency {
    micros: Mutex<Exact>,
}

impl ExactLatency {
    /// Records one event's latency (negative ones, a clock step, as 0).
    pub fn record(&self, micros: i64) {
        self.record_n(micros, 1);
    }

    /// Records the same latency for `events` events.
    pub fn record_n(&self, micros: i64, events: u64) {
        if let Ok(mut h) = self.micros.lock() {
            h.record_n(u64::try_from(micros).unwrap_or(0), events);
        }
    }

    /// `events`, p50, p99, p99.9 and max in milliseconds; `None` before the
    /// first event.
    pub fn summary(&self) -> Option<LatencySummary> {
        self.micros.lock().ok()?.summary()
    }
}

/// An acknowledged event's time from walbox reading it to walbox handling
/// its delivery report, split: walbox's own part and the broker client's
/// (its queue, the linger, the broker's round trip), as the client reports
/// it. Every event's, since walbox started, under one lock (one taking per
/// event).
#[derive(Debug, Default)]
pub struct SplitLatency(Mutex<SplitHistograms>);

#[derive(Debug, Default)]
struct SplitHistograms {
    read_to_send: Exact,
    read_to_ack: Exact,
    client: Exact,
    walbox: Exact,
}

/// The percentiles of a [`SplitLatency`], each `None` before its first event.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SplitSummary {
    /// Read to sent.
    pub read_to_send: Option<LatencySummary>,
    /// Read to acknowledged.
    pub read_to_ack: Option<LatencySummary>,
    /// The client's part.
    pub client: Option<LatencySummary>,
    /// walbox's own part.
    pub walbox: Option<LatencySummary>,
}

impl SplitLatency {
    /// Records one event, µs: from reading it to handing its record to the
    /// client, and to handling its report; of the latter, what the client
    /// held the record for by its own clock (`None` when it does not say:
    /// counted in the whole only). walbox's own part is the rest, never
    /// below 0 (the client's clock may start before walbox's send).
    pub fn record(&self, read_to_send: u64, read_to_ack: u64, client: Option<u64>) {
        if let Ok(mut h) = self.0.lock() {
            h.read_to_send.record_n(read_to_send, 1);
            h.read_to_ack.record_n(read_to_ack, 1);
            if let Some(client) = client {
                h.client.record_n(client, 1);
                h.walbox.record_n(read_to_ack.saturating_sub(client), 1);
            }
        }
    }

    /// The percentiles so far.
    pub fn summary(&self) -> Option<SplitSummary> {
        let h = self.0.lock().ok()?;
        Some(SplitSummary {
            read_to_send: h.read_to_send.summary(),
            read_to_ack: h.read_to_ack.summary(),
            client: h.client.summary(),
            walbox: h.walbox.summary(),
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

    #[test]
    fn the_split_keeps_walbox_part_apart_from_the_clients() {
        let l = SplitLatency::default();
        let s = l.summary().unwrap();
        assert_eq!((s.read_to_ack, s.walbox), (None, None));
        for i in 0..100 {
            l.record(100, 3_000 + i, Some(2_500));
        }
        // A client that does not say: counted in the whole, not in the parts.
        l.record(100, 9_000, None);
        // A client whose clock started before walbox's send: walbox's part
        // is 0, not negative (recorded as HDR's least value, 1 µs).
        l.record(100, 2_000, Some(2_400));
        let s = l.summary().unwrap();
        assert_eq!(s.read_to_ack.unwrap().events, 102);
        assert_eq!(s.walbox.unwrap().events, 101);
        assert_eq!(s.client.unwrap().events, 101);
        assert!((s.walbox.unwrap().max_ms - 0.599).abs() < 0.001, "{s:?}");
        assert!((s.client.unwrap().p99_ms - 2.5).abs() < 0.01, "{s:?}");
        assert!((s.read_to_ack.unwrap().max_ms - 9.0).abs() < 0.01, "{s:?}");
        assert!(
            (s.read_to_send.unwrap().p50_ms - 0.1).abs() < 0.001,
            "{s:?}"
        );
    }
}
