//! What librdkafka's statistics say about the producer, kept for the
//! metrics: its queue, and each broker's round trip.
//!
//! librdkafka emits them every `statistics.interval.ms` (walbox sets
//! [`STATISTICS_INTERVAL_MS`] unless the operator chose another value; `0`
//! turns them off). Only the last emission is kept: memory does not grow
//! with time or with the cluster beyond one entry per broker.

use std::sync::Mutex;

/// walbox's default `statistics.interval.ms`.
pub const STATISTICS_INTERVAL_MS: &str = "5000";

/// The producer's state in librdkafka's last statistics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProducerStats {
    /// Messages in the producer's queue (waiting or in flight to a broker).
    pub queue_messages: u64,
    /// Their bytes.
    pub queue_bytes: u64,
    /// Each broker's request round trip, in seconds.
    pub brokers: Vec<BrokerRtt>,
}

/// A broker's request round trip over the last statistics window.
#[derive(Clone, Debug, PartialEq)]
pub struct BrokerRtt {
    /// The broker (`host:port/id`).
    pub broker: String,
    /// Mean, in seconds.
    pub mean_seconds: f64,
    /// 99th percentile, in seconds.
    pub p99_seconds: f64,
}

/// The last statistics, shared between librdkafka's thread and readers.
#[derive(Debug, Default)]
pub(crate) struct StatsCell(Mutex<Option<ProducerStats>>);

impl StatsCell {
    /// Keeps what matters of an emission.
    pub(crate) fn record(&self, s: &rdkafka::Statistics) {
        let mut brokers: Vec<BrokerRtt> = s
            .brokers
            .values()
            // The bootstrap entries (nodeid -1) stand for no broker.
            .filter(|b| b.nodeid >= 0)
            .filter_map(|b| {
                let rtt = b.rtt.as_ref()?;
                Some(BrokerRtt {
                    broker: b.name.clone(),
                    mean_seconds: rtt.avg as f64 / 1e6,
                    p99_seconds: rtt.p99 as f64 / 1e6,
                })
            })
            .collect();
        brokers.sort_by(|a, b| a.broker.cmp(&b.broker));
        let stats = ProducerStats {
            queue_messages: s.msg_cnt,
            queue_bytes: s.msg_size,
            brokers,
        };
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(stats);
    }

    /// The last statistics, if any were emitted.
    pub(crate) fn last(&self) -> Option<ProducerStats> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
