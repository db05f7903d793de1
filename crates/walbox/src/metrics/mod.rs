//! Prometheus metrics and health endpoints.
//!
//! | metric | type | meaning |
//! |---|---|---|
//! | `walbox_events_published_total{topic}` | counter | events the broker acknowledged (dead-lettered ones not included) |
//! | `walbox_events_dead_lettered_total{topic,kind}` | counter | events published to the dead-letter topic instead; `topic` is the one they were meant for (empty when the row named none), `kind` `unmappable`, `invalid` (format = avro: the payload does not fit its schema) or `refused` |
//! | `walbox_events_failed_total{topic,kind}` | counter | deliveries that failed and halted walbox; `kind` `permanent`, `fatal`, `retriable_exhausted`, `purged`, `withheld` |
//! | `walbox_in_flight_events` | gauge | events sent, not yet acknowledged |
//! | `walbox_in_flight_bytes` | gauge | their bytes (KiB granularity) |
//! | `walbox_slot_lag_bytes` | gauge | `pg_current_wal_lsn() - confirmed_flush_lsn`, every 10 s |
//! | `walbox_slot_safe_wal_size_bytes` | gauge | WAL that may still be written before the slot risks invalidation; absent when `max_slot_wal_keep_size` is unlimited |
//! | `walbox_build_info{version,librdkafka}` | gauge | 1 |
//! | `walbox_streaming` | gauge | 1 while streaming from the slot, else 0 |
//! | `walbox_standby` | gauge | 1 while waiting as a standby for the slot another instance streams from (the normal state of the pair's second pod), else 0 |
//! | `walbox_drift_unhealed` | gauge | 1 while a stop for publication drift is recorded and not healed (rows the stream did not carry are only in the table: `walbox resync --drift`, or `on_drift = "heal"` waiting for the fix), else 0 |
//! | `walbox_quarantined_aggregates` | gauge | `on_failure = "quarantine"`: aggregates held (their events wait in `walbox.quarantine` for `walbox quarantine release`) |
//! | `walbox_quarantined_events` | gauge | `on_failure = "quarantine"`: events held |
//! | `walbox_quarantine_held_total` | counter | events written to `walbox.quarantine` (the failing ones and those behind them) |
//! | `walbox_quarantine_released_total` | counter | held events released: acknowledged by the broker |
//! | `walbox_claim_checks_total` | counter | records whose value went to the object store (`claim_check.bucket`) |
//! | `walbox_claim_check_bytes_total` | counter | bytes of those values |
//! | `walbox_reconnects_total{reason}` | counter | sessions ended by a transient error and retried: `postgres`, `slot_busy`, `kafka`, `rabbitmq`, `sqs`, `transactions`, `schema_registry`, `other` |
//! | `walbox_history_changes_total{reason}` | counter | sessions that found the server on another WAL history, so nothing earlier is skipped as a replay: `timeline` (a failover or point-in-time recovery), `wal_behind` (the server's WAL ends before what walbox delivered or recorded: a restore on the same timeline) |
//! | `walbox_delivered_commit_age_seconds` | gauge | now − commit time of the newest transaction delivered with all before it (grows while the outbox is idle) |
//! | `walbox_oldest_unacked_event_age_seconds` | gauge | now − commit time of the oldest event sent and not acknowledged; 0 when none waits |
//! | `walbox_producer_queue_messages` / `_bytes` | gauge | librdkafka's producer queue (its statistics, every 5 s) |
//! | `walbox_broker_round_trip_seconds{broker,stat}` | gauge | each broker's request round trip, `stat` `mean` or `p99` (librdkafka's statistics) |
//! | `process_*` | | CPU seconds, resident and virtual memory, threads, open and max file descriptors, start time |
//! | `walbox_received_lsn` | gauge | last WAL position received from the slot |
//! | `walbox_confirmed_lsn` | gauge | last position confirmed to Postgres |
//! | `walbox_slot_retained_wal_bytes` | gauge | WAL the slot keeps (`pg_current_wal_lsn() - restart_lsn`), every 10 s |
//! | `walbox_commit_to_ack_seconds` | histogram | from the transaction's commit to the broker's acknowledgement |
//! | `walbox_retention_rows_deleted_total` | counter | outbox rows deleted by `retention` |
//! | `walbox_retention_partitions_dropped_total` | counter | outbox partitions dropped by `retention` (partitioned outbox) |
//! | `walbox_retention_partitions_created_total` | counter | outbox partitions created ahead by `retention` |
//! | `walbox_audit_checked_total` | counter | continuous audit: acknowledged events read back from the broker |
//! | `walbox_audit_missing_total` | counter | continuous audit: of those, gone from the broker |
//! | `walbox_audit_duplicates_total` | counter | continuous audit: copies beyond the first found near them |
//! | `walbox_receipts_written_total` | counter | delivery receipts written to `walbox.receipts` |
//! | `walbox_receipts_dropped_total` | counter | receipts not written: the writer was behind (its queue full) |
//! | `walbox_receipts_failed_total` | counter | receipts not written: writing them failed |
//! | `walbox_delivery_stalled_seconds` | gauge | how long events have waited without any delivery report (0 when nothing waits or reports keep coming) |
//! | `walbox_backlog_over_budget` | gauge | 1 while `walbox.backlog()` says the slot is over its budget (`backlog.max_bytes`, `backlog.max_age`): `walbox.require_capacity()` refuses writes; read every second when `walbox migrate` installed it |
//!
//! `/healthz` answers 200 while the process runs; `/readyz` 200 while it
//! streams from the slot and deliveries move, 503 otherwise (connecting,
//! retrying, waiting for a busy slot, or deliveries stalled for 30 s: see
//! [`crate::stall`]); `/readyz?standby=ready` also 200 for a standby
//! waiting for the slot another instance holds.

pub mod latency;
mod process;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Bucket bounds of `walbox_commit_to_ack_seconds`: fine around the tens of
/// milliseconds a healthy relay shows (with bounds at 10 and 20 ms to read a
/// latency objective off directly), coarse out to the minutes of a broker
/// outage.
pub const COMMIT_TO_ACK_BUCKETS: [f64; 19] = [
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

/// The `topic` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TopicLabel {
    /// Topic.
    pub topic: String,
}

/// The labels of a failed or dead-lettered event.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// Topic the event was meant for.
    pub topic: String,
    /// A stable snake_case word: `permanent`, `fatal`, `unmappable`, `refused`, …
    pub kind: &'static str,
}

/// The labels of `walbox_build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    /// walbox's version.
    pub version: String,
    /// librdkafka's.
    pub librdkafka: String,
}

/// The `reason` label of `walbox_reconnects_total` and
/// `walbox_history_changes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// `postgres`, `slot_busy`, `kafka`, `transactions`, `schema_registry`,
    /// `other`; `timeline`, `wal_behind`.
    pub reason: &'static str,
}

/// The labels of `walbox_broker_round_trip_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoundTripLabels {
    /// The broker (`host:port/id`).
    pub broker: String,
    /// `mean` or `p99`.
    pub stat: &'static str,
}

/// A gauge of seconds.
type Seconds = Gauge<f64, AtomicU64>;

/// Every metric walbox exports.
pub struct Metrics {
    /// Sessions ended by a transient error, by reason.
    pub reconnects: Family<ReasonLabel, Counter>,
    /// Sessions that found the server on another history, by reason.
    history_changes: Family<ReasonLabel, Counter>,
    /// WAL written since the slot's confirmed position.
    slot_lag_bytes: Gauge,
    /// `safe_wal_size`, absent when `max_slot_wal_keep_size` is unlimited.
    slot_safe_wal_size: Family<Vec<(String, String)>, Gauge>,
    /// librdkafka's producer queue, messages.
    pub producer_queue_messages: Gauge,
    /// librdkafka's producer queue, bytes.
    pub producer_queue_bytes: Gauge,
    /// Each broker's round trip.
    pub broker_round_trip: Family<RoundTripLabels, Seconds>,
    /// `walbox_streaming`, also what readiness reads.
    streaming: Gauge,
    /// `walbox_drift_unhealed`.
    pub drift_unhealed: Gauge,
    /// `walbox_quarantined_aggregates`.
    pub quarantined_aggregates: Gauge,
    /// `walbox_quarantined_events`.
    pub quarantined_events: Gauge,
    /// `walbox_quarantine_held_total`.
    pub quarantine_held: Counter,
    /// `walbox_quarantine_released_total`.
    pub quarantine_released: Counter,
    /// `walbox_claim_checks_total`.
    pub claim_checks: Counter,
    /// `walbox_claim_check_bytes_total`.
    pub claim_check_bytes: Counter,
    delivered_commit_age: Seconds,
    oldest_unacked_age: Seconds,
    /// Unix µs of the newest delivered commit; 0 for none.
    delivered_commit_micros: AtomicI64,
    /// Unix µs of the oldest unacked event's commit; 0 for none.
    oldest_unacked_micros: AtomicI64,
    /// Events acknowledged, by topic.
    pub published: Family<TopicLabel, Counter>,
    /// Events dead-lettered, by original topic and kind.
    pub dead_lettered: Family<KindLabels, Counter>,
    /// Events failed, by topic and kind.
    pub failed: Family<KindLabels, Counter>,
    /// Events of replayed transactions not sent again.
    pub replays_skipped: Counter,
    /// Events of a replay found on the broker at a start, not sent again.
    pub found_delivered: Counter,
    /// Topics that could not be read back at a start.
    pub tail_reads_failed: Counter,
    /// Non-transactional logical decoding messages with the events' prefix
    /// (not published).
    pub nontransactional_messages: Counter,
    /// Exactly-once: Kafka transactions committed.
    pub transactions_committed: Counter,
    /// Exactly-once: Kafka transactions aborted (their events written again).
    pub transactions_aborted: Counter,
    /// Exactly-once: how long commits took (the records' deliveries, then
    /// the coordinator's markers).
    pub transaction_commit: Histogram,
    /// Events in flight.
    pub in_flight_events: Gauge,
    /// Bytes in flight.
    pub in_flight_bytes: Gauge,
    /// Last received LSN.
    pub received_lsn: Gauge,
    /// Last confirmed LSN.
    pub confirmed_lsn: Gauge,
    /// WAL retained by the slot.
    pub retained_wal_bytes: Gauge,
    /// Commit-to-ack latency.
    pub commit_to_ack: Histogram,
    /// The same latencies, exactly (for the percentiles logged at exit).
    pub commit_to_ack_exact: latency::ExactLatency,
    /// Commit to the transaction's end read by walbox, per event, exactly
    /// (logged at exit beside commit to ack).
    pub commit_to_read_exact: latency::ExactLatency,
    /// Read to ack, per event at least once, split into walbox's own part
    /// and the broker client's (logged at exit beside commit to ack).
    pub read_to_ack_split: latency::SplitLatency,
    /// Seconds without a delivery report while events wait.
    pub delivery_stalled_seconds: Gauge,
    /// 1 while over the backlog budget (`walbox.backlog()`), else 0.
    pub backlog_over_budget: Gauge,
    /// Outbox rows deleted by retention.
    pub retention_rows_deleted: Counter,
    /// Outbox partitions dropped by retention.
    pub retention_partitions_dropped: Counter,
    /// Outbox partitions created ahead by retention.
    pub retention_partitions_created: Counter,
    /// Continuous audit: acknowledged events read back.
    pub audit_checked: Counter,
    /// Continuous audit: of those, gone from the broker.
    pub audit_missing: Counter,
    /// Continuous audit: copies beyond the first near them.
    pub audit_duplicates: Counter,
    /// Delivery receipts written.
    pub receipts_written: Counter,
    /// Receipts dropped: the writer's queue was full.
    pub receipts_dropped: Counter,
    /// Receipts lost to a failed write.
    pub receipts_failed: Counter,
    /// `walbox_standby`, also what `/readyz?standby=ready` reads.
    standby: Gauge,
    stalled: AtomicBool,
    /// Topics that have their own label value (see [`Metrics::topic_label`]).
    labelled_topics: std::sync::Mutex<std::collections::HashSet<String>>,
    /// The counter of the topic counted last ([`Metrics::count_published`]):
    /// a run of one topic's events finds it without hashing its label.
    last_published: std::sync::Mutex<Option<(Arc<str>, Counter)>>,
    registry: Registry,
}

/// At most this many topics get their own `topic` label value; events of
/// further topics are counted under [`OTHER_TOPICS`], so a topic template
/// fed by arbitrary values cannot grow the metrics without bound.
pub const MAX_TOPIC_LABELS: usize = 1_000;

/// The `topic` label value past [`MAX_TOPIC_LABELS`].
pub const OTHER_TOPICS: &str = "_other";

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::default();
        let published = Family::<TopicLabel, Counter>::default();
        let dead_lettered = Family::<KindLabels, Counter>::default();
        let failed = Family::<KindLabels, Counter>::default();
        let replays_skipped = Counter::default();
        let (found_delivered, tail_reads_failed) = (Counter::default(), Counter::default());
        let nontransactional_messages = Counter::default();
        let (in_flight_events, in_flight_bytes) = (Gauge::default(), Gauge::default());
        let (received_lsn, confirmed_lsn, retained_wal_bytes) =
            (Gauge::default(), Gauge::default(), Gauge::default());
        let commit_to_ack = Histogram::new(COMMIT_TO_ACK_BUCKETS.iter().copied());
        registry.register(
            "walbox_events_published",
            "Events the broker acknowledged",
            published.clone(),
        );
        registry.register(
            "walbox_events_dead_lettered",
            "Events published to the dead-letter topic instead of their own",
            dead_lettered.clone(),
        );
        registry.register(
            "walbox_events_failed",
            "Events that failed to publish",
            failed.clone(),
        );
        registry.register(
            "walbox_events_replay_skipped",
            "Events Postgres re-sent after a reconnect that walbox had already delivered (not sent again)",
            replays_skipped.clone(),
        );
        registry.register(
            "walbox_events_found_delivered",
            "Events of a replay found already on the broker when walbox started (skip_delivered), not sent again",
            found_delivered.clone(),
        );
        registry.register(
            "walbox_tail_reads_failed",
            "Topics walbox could not read back when it started (skip_delivered): their replayed events were sent again",
            tail_reads_failed.clone(),
        );
        registry.register(
            "walbox_nontransactional_messages",
            "Non-transactional logical decoding messages with the events' prefix: not published, since they are sent even when their transaction rolls back",
            nontransactional_messages.clone(),
        );
        registry.register(
            "walbox_in_flight_events",
            "Events sent, not yet acknowledged",
            in_flight_events.clone(),
        );
        registry.register(
            "walbox_in_flight_bytes",
            "Bytes of events in flight",
            in_flight_bytes.clone(),
        );
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_owned(),
                librdkafka: sink_kafka::librdkafka_version(),
            })
            .set(1);
        registry.register("walbox_build_info", "walbox's build: 1", build_info);
        let streaming = Gauge::default();
        registry.register(
            "walbox_streaming",
            "1 while streaming from the slot, 0 otherwise (connecting, retrying, waiting for a slot another instance holds)",
            streaming.clone(),
        );
        let standby = Gauge::default();
        registry.register(
            "walbox_standby",
            "1 while waiting as a standby for the slot another instance streams from, else 0",
            standby.clone(),
        );
        let drift_unhealed = Gauge::default();
        registry.register(
            "walbox_drift_unhealed",
            "1 while a stop for publication drift is recorded and not healed: rows the stream did not carry are only in the table (walbox resync --drift, or on_drift = heal waiting for the fix)",
            drift_unhealed.clone(),
        );
        let (quarantined_aggregates, quarantined_events) = (Gauge::default(), Gauge::default());
        registry.register(
            "walbox_quarantined_aggregates",
            "on_failure = quarantine: aggregates held, their events waiting in walbox.quarantine for walbox quarantine release",
            quarantined_aggregates.clone(),
        );
        registry.register(
            "walbox_quarantined_events",
            "on_failure = quarantine: events held in walbox.quarantine",
            quarantined_events.clone(),
        );
        let (quarantine_held, quarantine_released) = (Counter::default(), Counter::default());
        registry.register(
            "walbox_quarantine_held",
            "Events written to walbox.quarantine: the ones that failed for good and those of their aggregates behind them",
            quarantine_held.clone(),
        );
        registry.register(
            "walbox_quarantine_released",
            "Held events released and acknowledged by the broker",
            quarantine_released.clone(),
        );
        let (claim_checks, claim_check_bytes) = (Counter::default(), Counter::default());
        registry.register(
            "walbox_claim_checks",
            "Records whose value was stored in the object store (claim_check.bucket) and replaced by a pointer",
            claim_checks.clone(),
        );
        registry.register(
            "walbox_claim_check_bytes",
            "Bytes of the values stored in the object store",
            claim_check_bytes.clone(),
        );
        let reconnects = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "walbox_reconnects",
            "Sessions ended by a transient error and started again, by reason",
            reconnects.clone(),
        );
        let history_changes = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "walbox_history_changes",
            "Sessions that found the server on another WAL history (nothing earlier is skipped as a replay), by reason: timeline, wal_behind",
            history_changes.clone(),
        );
        let (delivered_commit_age, oldest_unacked_age) = (Seconds::default(), Seconds::default());
        registry.register(
            "walbox_delivered_commit_age_seconds",
            "Now minus the commit time of the newest transaction delivered with every one before it (grows while the outbox is idle)",
            delivered_commit_age.clone(),
        );
        registry.register(
            "walbox_oldest_unacked_event_age_seconds",
            "Now minus the commit time of the oldest event sent and not yet acknowledged; 0 when none waits",
            oldest_unacked_age.clone(),
        );
        let (producer_queue_messages, producer_queue_bytes) = (Gauge::default(), Gauge::default());
        registry.register(
            "walbox_producer_queue_messages",
            "Messages in librdkafka's producer queue (from its statistics, every 5 s)",
            producer_queue_messages.clone(),
        );
        registry.register(
            "walbox_producer_queue_bytes",
            "Bytes of the messages in librdkafka's producer queue (from its statistics)",
            producer_queue_bytes.clone(),
        );
        let broker_round_trip = Family::<RoundTripLabels, Seconds>::default();
        registry.register(
            "walbox_broker_round_trip_seconds",
            "Each broker's request round trip over librdkafka's last statistics window, stat mean or p99",
            broker_round_trip.clone(),
        );
        let slot_lag_bytes = Gauge::default();
        registry.register(
            "walbox_slot_lag_bytes",
            "WAL written since the slot's confirmed position (pg_current_wal_lsn() - confirmed_flush_lsn), every 10 s",
            slot_lag_bytes.clone(),
        );
        let slot_safe_wal_size = Family::<Vec<(String, String)>, Gauge>::default();
        registry.register(
            "walbox_slot_safe_wal_size_bytes",
            "WAL that can still be written before the slot risks invalidation (max_slot_wal_keep_size); absent when unlimited",
            slot_safe_wal_size.clone(),
        );
        registry.register_collector(Box::new(process::ProcessCollector));
        registry.register(
            "walbox_received_lsn",
            "Last WAL position received from the slot",
            received_lsn.clone(),
        );
        registry.register(
            "walbox_confirmed_lsn",
            "Last WAL position confirmed to Postgres",
            confirmed_lsn.clone(),
        );
        registry.register(
            "walbox_slot_retained_wal_bytes",
            "WAL kept by the slot (pg_current_wal_lsn() - restart_lsn)",
            retained_wal_bytes.clone(),
        );
        registry.register(
            "walbox_commit_to_ack_seconds",
            "Time from an event's transaction commit to the broker's acknowledgement",
            commit_to_ack.clone(),
        );
        let (transactions_committed, transactions_aborted) =
            (Counter::default(), Counter::default());
        registry.register(
            "walbox_transactions_committed",
            "Exactly-once: Kafka transactions committed (their events became visible)",
            transactions_committed.clone(),
        );
        registry.register(
            "walbox_transactions_aborted",
            "Exactly-once: Kafka transactions aborted (their events are written again)",
            transactions_aborted.clone(),
        );
        let transaction_commit = Histogram::new(COMMIT_TO_ACK_BUCKETS.iter().copied());
        registry.register(
            "walbox_transaction_commit_seconds",
            "Exactly-once: time a Kafka transaction's commit took (its records' deliveries, then the markers)",
            transaction_commit.clone(),
        );
        let backlog_over_budget = Gauge::default();
        registry.register(
            "walbox_backlog_over_budget",
            "1 while walbox.backlog() says the slot is over its budget (backlog.max_bytes, backlog.max_age) and walbox.require_capacity() refuses writes, else 0",
            backlog_over_budget.clone(),
        );
        let delivery_stalled_seconds = Gauge::default();
        registry.register(
            "walbox_delivery_stalled_seconds",
            "Seconds events have waited without any delivery report (the broker retries without end)",
            delivery_stalled_seconds.clone(),
        );
        let retention = [
            ("walbox_retention_rows_deleted", "Outbox rows deleted by retention (older than it, and delivered)"),
            ("walbox_retention_partitions_dropped", "Outbox partitions dropped by retention (all their rows older than it, and delivered)"),
            ("walbox_retention_partitions_created", "Outbox partitions created ahead by retention"),
        ]
        .map(|(name, help)| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        });
        let [retention_rows_deleted, retention_partitions_dropped, retention_partitions_created] =
            retention;
        let audit = [
            ("walbox_audit_checked", "Continuous audit (audit.interval): events the broker acknowledged, read back from it"),
            ("walbox_audit_missing", "Continuous audit: of the events read back, those gone from the broker (deleted, or no record at their offset)"),
            ("walbox_audit_duplicates", "Continuous audit: copies beyond the first found within 1,000 offsets of an event read back"),
        ]
        .map(|(name, help)| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        });
        let [audit_checked, audit_missing, audit_duplicates] = audit;
        let receipts = [
            ("walbox_receipts_written", "Delivery receipts (receipts = true) written to walbox.receipts"),
            ("walbox_receipts_dropped", "Delivery receipts not written because the writer was behind (its queue full); the events were delivered"),
            ("walbox_receipts_failed", "Delivery receipts not written because writing them failed; the events were delivered"),
        ]
        .map(|(name, help)| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        });
        let [receipts_written, receipts_dropped, receipts_failed] = receipts;
        Arc::new(Metrics {
            reconnects,
            history_changes,
            slot_lag_bytes,
            slot_safe_wal_size,
            producer_queue_messages,
            producer_queue_bytes,
            broker_round_trip,
            streaming,
            drift_unhealed,
            quarantined_aggregates,
            quarantined_events,
            quarantine_held,
            quarantine_released,
            claim_checks,
            claim_check_bytes,
            delivered_commit_age,
            oldest_unacked_age,
            delivered_commit_micros: AtomicI64::new(0),
            oldest_unacked_micros: AtomicI64::new(0),
            published,
            retention_rows_deleted,
            retention_partitions_dropped,
            retention_partitions_created,
            audit_checked,
            audit_missing,
            audit_duplicates,
            receipts_written,
            receipts_dropped,
            receipts_failed,
            dead_lettered,
            failed,
            replays_skipped,
            found_delivered,
            tail_reads_failed,
            nontransactional_messages,
            transactions_committed,
            transactions_aborted,
            transaction_commit,
            labelled_topics: std::sync::Mutex::new(std::collections::HashSet::new()),
            last_published: std::sync::Mutex::new(None),
            in_flight_events,
            in_flight_bytes,
            received_lsn,
            confirmed_lsn,
            retained_wal_bytes,
            commit_to_ack,
            commit_to_ack_exact: latency::ExactLatency::default(),
            commit_to_read_exact: latency::ExactLatency::default(),
            read_to_ack_split: latency::SplitLatency::default(),
            delivery_stalled_seconds,
            backlog_over_budget,
            standby,
            stalled: AtomicBool::new(false),
            registry,
        })
    }

    /// The `topic` label value for `topic`: itself for the first
    /// [`MAX_TOPIC_LABELS`] topics seen, [`OTHER_TOPICS`] after.
    pub fn topic_label(&self, topic: &str) -> String {
        let mut known = self.labelled_topics.lock().expect("not poisoned");
        if known.contains(topic) {
            return topic.to_owned();
        }
        if known.len() >= MAX_TOPIC_LABELS {
            return OTHER_TOPICS.to_owned();
        }
        known.insert(topic.to_owned());
        topic.to_owned()
    }

    /// Counts an event published to `topic` (`walbox_events_published_total`).
    /// Per event: the last topic's counter is kept, so the label is looked
    /// up only when the topic changes.
    pub fn count_published(&self, topic: &Arc<str>) {
        let mut last = self.last_published.lock().expect("not poisoned");
        if let Some((t, counter)) = &*last {
            if Arc::ptr_eq(t, topic) || **t == **topic {
                counter.inc();
                return;
            }
        }
        let label = TopicLabel {
            topic: self.topic_label(topic),
        };
        let counter = self.published.get_or_create(&label).clone();
        counter.inc();
        *last = Some((Arc::clone(topic), counter));
    }

    /// Marks whether the relay is streaming (readiness).
    pub fn set_streaming(&self, streaming: bool) {
        self.streaming.set(i64::from(streaming));
        if streaming {
            self.set_standby(false);
        }
    }

    /// Marks whether this instance is a standby: the slot is held by
    /// another process, and this one waits to take it over.
    pub fn set_standby(&self, standby: bool) {
        self.standby.set(i64::from(standby));
    }

    /// Notes the commit times the lag gauges are computed from at scrape:
    /// the newest delivered transaction's, and the oldest unacked event's.
    pub fn set_commit_times(
        &self,
        delivered: Option<pgoutput_decoder::PgTimestamp>,
        oldest_unacked: Option<pgoutput_decoder::PgTimestamp>,
    ) {
        let micros = |t: Option<pgoutput_decoder::PgTimestamp>| t.map_or(0, |t| t.as_unix_micros());
        self.delivered_commit_micros
            .store(micros(delivered), Ordering::Relaxed);
        self.oldest_unacked_micros
            .store(micros(oldest_unacked), Ordering::Relaxed);
    }

    /// The commit time of the oldest event sent and not acknowledged, in
    /// Unix microseconds; `None` when none waits.
    pub fn oldest_unacked_micros(&self) -> Option<i64> {
        match self.oldest_unacked_micros.load(Ordering::Relaxed) {
            0 => None,
            micros => Some(micros),
        }
    }

    /// Copies librdkafka's last statistics into the producer gauges.
    pub fn set_producer_stats(&self, stats: &sink_kafka::ProducerStats) {
        self.producer_queue_messages
            .set(i64::try_from(stats.queue_messages).unwrap_or(i64::MAX));
        self.producer_queue_bytes
            .set(i64::try_from(stats.queue_bytes).unwrap_or(i64::MAX));
        self.broker_round_trip.clear();
        for b in &stats.brokers {
            for (stat, value) in [("mean", b.mean_seconds), ("p99", b.p99_seconds)] {
                self.broker_round_trip
                    .get_or_create(&RoundTripLabels {
                        broker: b.broker.clone(),
                        stat,
                    })
                    .set(value);
            }
        }
    }

    /// Notes a sample of the slot's state.
    pub fn set_slot(&self, slot: &slot_manager::SlotStatus) {
        if let Some(bytes) = slot.retained_wal_bytes {
            self.retained_wal_bytes.set(bytes);
        }
        if let Some(bytes) = slot.confirmed_lag_bytes {
            self.slot_lag_bytes.set(bytes);
        }
        match slot.safe_wal_size {
            Some(bytes) => {
                self.slot_safe_wal_size
                    .get_or_create(&Vec::new())
                    .set(bytes);
            }
            None => self.slot_safe_wal_size.clear(),
        }
    }

    /// Counts a session ended by a transient error.
    pub fn count_reconnect(&self, reason: &'static str) {
        self.reconnects.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Counts a session that found the server on another history.
    pub fn count_history_change(&self, reason: &'static str) {
        self.history_changes
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// True while waiting as a standby.
    pub fn is_standby(&self) -> bool {
        self.standby.get() == 1
    }

    /// True while streaming.
    pub fn is_streaming(&self) -> bool {
        self.streaming.get() == 1
    }

    /// Marks whether deliveries are stalled (readiness).
    pub fn set_stalled(&self, stalled: bool) {
        self.stalled.store(stalled, Ordering::Relaxed);
    }

    /// True while deliveries are stalled.
    pub fn is_stalled(&self) -> bool {
        self.stalled.load(Ordering::Relaxed)
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let now = pgoutput_decoder::PgTimestamp::now().as_unix_micros();
        let age = |micros: i64| {
            if micros == 0 {
                0.0
            } else {
                (now - micros).max(0) as f64 / 1e6
            }
        };
        self.delivered_commit_age
            .set(age(self.delivered_commit_micros.load(Ordering::Relaxed)));
        self.oldest_unacked_age
            .set(age(self.oldest_unacked_micros.load(Ordering::Relaxed)));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// `/readyz`: 200 while streaming and deliveries move; 503 otherwise. With
/// `?standby=ready` a standby waiting for the slot another instance holds
/// answers 200 too: it is doing its job (the Kubernetes chart probes this,
/// so an active/standby pair is two ready pods and rollouts and disruption
/// budgets work).
fn readiness(m: &Metrics, standby_ready: bool) -> (StatusCode, &'static str) {
    if m.is_streaming() && m.is_stalled() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "streaming, but deliveries are stalled\n",
        )
    } else if m.is_streaming() {
        (StatusCode::OK, "streaming\n")
    } else if m.is_standby() {
        let status = if standby_ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        (
            status,
            "standby: waiting for the slot another instance holds\n",
        )
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not streaming\n")
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
) -> std::io::Result<()> {
    let for_metrics = Arc::clone(&metrics);
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = Arc::clone(&for_metrics);
                async move {
                    (
                        [(
                            "content-type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        m.encode(),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move |uri: axum::http::Uri| {
                let m = Arc::clone(&metrics);
                let standby_ready = uri
                    .query()
                    .is_some_and(|q| q.split('&').any(|kv| kv == "standby=ready"));
                async move { readiness(&m, standby_ready) }
            }),
        );
    axum::serve(listener, app).await
}

#[cfg(test)]
mod label_tests {
    use super::*;

    /// The kept counter serves a run of one topic; a topic of the same
    /// name in another allocation, and topics taking turns, count right.
    #[test]
    fn published_events_count_per_topic() {
        let m = Metrics::new();
        let a: Arc<str> = Arc::from("orders");
        let b: Arc<str> = Arc::from("payments");
        let a_again: Arc<str> = Arc::from("orders");
        for topic in [&a, &a, &b, &a_again, &b, &a] {
            m.count_published(topic);
        }
        let count = |t: &str| {
            m.published
                .get_or_create(&TopicLabel { topic: t.into() })
                .get()
        };
        assert_eq!((count("orders"), count("payments")), (4, 2));
    }

    #[test]
    fn topic_labels_are_bounded() {
        let m = Metrics::new();
        for i in 0..MAX_TOPIC_LABELS {
            assert_eq!(m.topic_label(&format!("t{i}")), format!("t{i}"));
        }
        assert_eq!(m.topic_label("one-too-many"), OTHER_TOPICS);
        assert_eq!(m.topic_label("t7"), "t7", "a known topic keeps its label");
    }
}
