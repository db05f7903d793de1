//! The core's observations written out: metrics, log lines, receipts,
//! spans ended, the continuous audit's samples. The core decides what
//! happened and what it says; this is the only place that writes it.

use std::sync::Arc;
use std::time::SystemTime;

use pgoutput_decoder::PgTimestamp;
use sink_core::Delivered;

use crate::metrics::{KindLabels, Metrics};
use crate::receipts::Receipt;
use crate::relay::core::{HistoryChange, Observation, Positions, ProgressNote, TransactionNote};
use crate::relay::{RelayConfig, Token};

/// Writes `observation` out.
pub(in crate::relay) fn observe(config: &RelayConfig, metrics: &Metrics, observation: Observation) {
    match observation {
        Observation::Delivered {
            token,
            at,
            wall,
            split,
        } => {
            if let Some(at) = &at {
                receipt(config, &token, at);
            }
            if let Some(s) = split {
                metrics
                    .read_to_ack_split
                    .record(s.read_to_send, s.read_to_report, s.client);
            }
            count_delivered(config, metrics, &token, wall);
        }
        Observation::Acknowledged { token, at } => receipt(config, &token, &at),
        Observation::Released { token, at } => {
            metrics.quarantine_released.inc();
            receipt(config, &token, &at);
        }
        Observation::Sampled {
            event_id,
            topic,
            at,
        } => {
            if let Some(tap) = &config.audit {
                tap.delivered(&event_id, &topic, &at);
            }
        }
        Observation::Read { events, micros } => {
            metrics.commit_to_read_exact.record_n(micros, events);
        }
        Observation::ReplaySkipped => {
            metrics.replays_skipped.inc();
        }
        Observation::FoundDelivered { token, at } => {
            metrics.found_delivered.inc();
            receipt(config, &token, &at);
        }
        Observation::TailRead {
            topic,
            partitions,
            read,
            found,
            cut_short,
            micros,
        } => {
            let ms = micros / 1000;
            tracing::info!(%topic, partitions, records_read = read, found, ms, "read the topic back: the events of the replay found there are not sent again");
            if !cut_short.is_empty() {
                tracing::warn!(%topic, partitions = ?cut_short, "the look-back ended before a confirmed record of this slot in these partitions: replayed events older than what was read are sent again (duplicates, never loss)");
            }
        }
        Observation::TailUnreadable { topic, error } => {
            metrics.tail_reads_failed.inc();
            tracing::warn!(%topic, %error, "could not read the topic back: the replayed events for it are sent again (duplicates, never loss)");
        }
        Observation::HistoryChanged(change) => history_changed(metrics, change),
        Observation::SlotBehind { slot, delivered } => {
            tracing::warn!(%slot, %delivered, "the slot resumed before what walbox confirmed (Postgres restarted before a checkpoint?); transactions up to the confirmed position are skipped, not sent twice");
        }
        Observation::NonTransactional { lsn, prefix, first } => {
            // Said once per process, counted always.
            metrics.nontransactional_messages.inc();
            if first {
                tracing::error!(%lsn, %prefix, "a non-transactional logical decoding message has the events' prefix: it is not published (it would be sent even if its transaction rolled back); emit events with pg_logical_emit_message(true, …) or walbox.emit()");
            }
        }
        Observation::Renamed { oid, name } => {
            tracing::info!(oid, %name, "the outbox table appears under another name");
        }
        Observation::ChangePending { slot, waited } => {
            tracing::warn!(%slot, ?waited, "a transaction changing the publication or the outbox table has not ended (open, or waiting for synchronous standbys): the slot is not confirmed past its start until it ends");
        }
        Observation::TableDropped { table } => {
            tracing::info!(%table, "an outbox table was dropped");
        }
        Observation::DeadLettering {
            why,
            error,
            topic,
            lsn,
            dead_letter_topic,
        } => {
            let topic = topic.as_deref().unwrap_or("");
            tracing::warn!(%error, %topic, %lsn, %dead_letter_topic, "{why}");
        }
        Observation::Stopping { what, error, lsn } => {
            tracing::error!(%error, %lsn, "{what}");
        }
        Observation::DeliveryFailed {
            topic,
            kind,
            error,
            lsn,
        } => {
            metrics
                .failed
                .get_or_create(&KindLabels {
                    topic: metrics.topic_label(&topic),
                    kind: kind.as_str(),
                })
                .inc();
            tracing::error!(%error, %topic, %lsn, "delivery failed");
        }
        Observation::StaleFailure { error } => {
            tracing::debug!(%error, "a report of an earlier session failed; ignored");
        }
        Observation::PositionNotSaved { error } => {
            tracing::warn!(%error, "cannot save the delivered position in walbox.positions: should the slot be lost, walbox republishes from the last position saved, or cannot recreate it (grant walbox's role INSERT and UPDATE on walbox.positions, or CREATE on the database)");
        }
        Observation::PositionSavedAgain => {
            tracing::info!("saving the delivered position in walbox.positions again");
        }
        Observation::Progress(note) => progress(note),
        Observation::Transaction(note) => transaction(metrics, note),
        Observation::Holding { key, lsn, error } => {
            let key = String::from_utf8_lossy(&key);
            tracing::warn!(%key, %lsn, %error, "holding the aggregate: this event and every later one of it go to walbox.quarantine until released");
        }
        Observation::Releasing { key } => {
            let key = String::from_utf8_lossy(&key);
            tracing::info!(%key, "releasing a held aggregate");
        }
        Observation::ReleaseRefused { key, error } => {
            let key = String::from_utf8_lossy(&key);
            tracing::error!(%key, %error, "a released event was refused again: the release stops, the aggregate stays held");
        }
        Observation::FlowsAgain { key } => {
            let key = String::from_utf8_lossy(&key);
            tracing::info!(%key, "the aggregate flows again");
        }
        Observation::Held { new } => {
            metrics.quarantine_held.inc_by(new);
        }
        Observation::DroppedHeld { key, events } => {
            let key = String::from_utf8_lossy(&key);
            tracing::warn!(%key, events, "dropped a held aggregate's events, as asked");
        }
        Observation::Quarantined { aggregates, events } => {
            metrics.quarantined_aggregates.set(aggregates as i64);
            metrics.quarantined_events.set(events as i64);
        }
    }
}

/// The gauges: what is in flight (the destination's count and bytes),
/// positions, commit times.
pub(super) fn gauges(metrics: &Metrics, positions: Positions, in_flight: usize, bytes: usize) {
    metrics.in_flight_events.set(in_flight as i64);
    metrics.in_flight_bytes.set(bytes as i64);
    metrics.received_lsn.set(positions.received.as_u64() as i64);
    metrics
        .confirmed_lsn
        .set(positions.confirmable.as_u64() as i64);
    metrics.set_commit_times(
        positions.delivered_commit_time,
        positions.oldest_unacked_commit_time,
    );
}

fn history_changed(metrics: &Metrics, change: HistoryChange) {
    match change {
        HistoryChange::Timeline { before, now } => {
            tracing::warn!(%before, %now, "the server's history changed (failover or restore): resuming from the slot's position");
            metrics.count_history_change("timeline");
        }
        HistoryChange::WalBehind {
            server_wal,
            delivered,
        } => {
            tracing::warn!(%server_wal, %delivered, "the server's WAL ends before what walbox delivered: it was restored on the same timeline (a disk snapshot, or a backup started without recovery); its transactions at those positions are new, resuming from the slot's position");
            metrics.count_history_change("wal_behind");
        }
        HistoryChange::ProgressPastWal {
            recorded,
            server_wal,
        } => {
            tracing::warn!(%recorded, %server_wal, "exactly-once: the committed progress lies past the end of the server's WAL: it was restored on the same timeline; resuming from the slot's position (events after it may be written again)");
            metrics.count_history_change("wal_behind");
        }
    }
}

fn progress(note: ProgressNote) {
    match note {
        ProgressNote::Forgotten => {
            tracing::warn!("the server's history changed: the committed progress no longer applies; events after the slot's position may be written again");
        }
        ProgressNote::None { topic, id } => {
            tracing::info!(%topic, transactional_id = %id, "exactly-once: no committed progress yet; starting from the slot's position");
        }
        ProgressNote::OtherHistory {
            topic,
            recorded,
            now,
        } => {
            tracing::warn!(%topic, %recorded, %now, "exactly-once: the committed progress belongs to another server history (failover or restore); events after the slot's position may be written again");
        }
        ProgressNote::Resuming { topic, id, after } => {
            tracing::info!(%topic, transactional_id = %id, %after, "exactly-once: resuming after the committed progress");
        }
    }
}

fn transaction(metrics: &Metrics, note: TransactionNote) {
    match note {
        TransactionNote::Closing { events, position } => {
            tracing::debug!(events, %position, "closing the Kafka transaction");
        }
        TransactionNote::Committing { events } => {
            tracing::debug!(events, "committing the Kafka transaction");
        }
        TransactionNote::CommitRetried { error } => {
            tracing::warn!(%error, "the commit did not finish in time; committing again");
        }
        TransactionNote::Ended { took, committed } => {
            metrics.transaction_commit.observe(took.as_secs_f64());
            if committed {
                metrics.transactions_committed.inc();
            }
        }
        TransactionNote::Refused { error, topic, lsn } => {
            tracing::warn!(%error, %topic, %lsn, "broker refused an event; it goes to the dead-letter topic when its transaction is written again");
        }
        TransactionNote::Aborted => {
            tracing::info!("aborted the open Kafka transaction");
            metrics.transactions_aborted.inc();
        }
        TransactionNote::AbortRetried { error } => {
            tracing::warn!(%error, "the abort did not finish in time; aborting again");
        }
    }
}

/// An acknowledged event's receipt, where the broker says it landed (at
/// least once; exactly-once refuses receipts: an acknowledged record may
/// still be aborted).
fn receipt(config: &RelayConfig, token: &Token, at: &Delivered) {
    let (Some(recorder), Some(id)) = (&config.receipts, &token.event_id) else {
        return;
    };
    // A dead-lettered copy landed on the dead-letter topic.
    let topic = match (token.dead_letter(), config.dead_letters.topic()) {
        (Some(_), Some(dead_letters)) => Arc::from(dead_letters),
        _ => Arc::clone(&token.topic),
    };
    recorder.record(Receipt {
        event_id: id.clone(),
        topic,
        at: at.clone(),
        acked_at: SystemTime::now(),
        dead_lettered: token.dead_letter().is_some(),
    });
}

/// Metrics of an event delivered at `wall` (at least once: acknowledged;
/// exactly once: its transaction committed), and its span ended.
fn count_delivered(config: &RelayConfig, metrics: &Metrics, token: &Token, wall: PgTimestamp) {
    match token.dead_letter() {
        Some(kind) => {
            metrics
                .dead_lettered
                .get_or_create(&KindLabels {
                    topic: metrics.topic_label(&token.topic),
                    kind: kind.as_str(),
                })
                .inc();
        }
        None => {
            metrics.count_published(&token.topic);
            // A backfilled row has no commit time: no latency.
            if token.commit_time != PgTimestamp::default() {
                let micros = wall.as_unix_micros() - token.commit_time.as_unix_micros();
                metrics.commit_to_ack.observe(micros.max(0) as f64 / 1e6);
                metrics.commit_to_ack_exact.record(micros);
            }
            if let (Some(spans), Some(span)) = (&config.spans, token.span()) {
                spans.end(span, token.commit_time, &token.topic, token.lsn);
            }
        }
    }
}
