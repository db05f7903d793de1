//! Publishing the copied rows: mapped exactly like streamed ones, sent
//! within the producer's in-flight bounds, the delivered prefix saved every
//! second ([`super::cursor`]).

use std::collections::VecDeque;
use std::time::Instant;

use pgoutput_decoder::{Lsn, RelationBody, TupleData};
use sink_kafka::{Record, Sink};
use slot_manager::domain_base_types;
use tokio_postgres::Client;

use super::cursor::Cursor;
use super::store::{self, Publishing};
use super::{BackfillError, Outcome, Plan, BATCH, REPORT_EVERY, SAVE_EVERY};
use crate::dead_letter::{DeadLetters, Origin};
use crate::mapping::{ColumnIndexes, OutboxMapping};

/// A record's token: its row, and whether it is the dead-letter copy.
type Token = (u64, bool);

/// Publishes rows after `p.published`, saving the cursor as deliveries
/// arrive.
pub(super) async fn publish(
    plan: Plan<'_>,
    control: &Client,
    p: &Publishing,
    resumed: bool,
) -> Result<Outcome, BackfillError> {
    let relation = RelationBody::from_catalog(
        0,
        plan.table.schema(),
        plan.table.name(),
        p.columns.iter().cloned(),
    );
    let domains = domain_base_types(control, plan.table).await?;
    let indexes = plan
        .mapping
        .resolve_with(&relation, &domains)
        .map_err(BackfillError::Mapping)?;
    let mut sink_config = plan.settings.sink.clone();
    // Not in a Kafka transaction: see the module's documentation.
    sink_config.transactional_id = None;
    let (sink, mut reports) =
        Sink::<Token>::new(&sink_config).map_err(crate::relay::RunError::from)?;
    crate::relay::check_brokers(&sink, &sink_config.bootstrap_servers).await?;

    let rows = Rows {
        mapping: plan.mapping,
        indexes: &indexes,
        dead_letters: &plan.settings.dead_letters,
        consistent_point: p.consistent_point,
    };
    let mut cursor = Cursor::after(p.published);
    let mut read_up_to = p.published;
    let mut outgoing: VecDeque<Record<Token>> = VecDeque::new();
    let mut dead_lettered = 0u64;
    let mut saved = p.published;
    let started = Instant::now();
    let mut save = tokio::time::interval(SAVE_EVERY);
    save.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut report = tokio::time::interval(REPORT_EVERY);
    report.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    report.tick().await;
    while cursor.done() < p.total {
        if outgoing.is_empty() && read_up_to < p.total && sink.in_flight() < BATCH as usize {
            for (n, values) in store::rows_after(control, plan.slot, read_up_to, BATCH).await? {
                read_up_to = n;
                outgoing.push_back(rows.record(n, &values)?);
            }
            if outgoing.is_empty() {
                // Fewer rows than recorded (deleted by hand): nothing more.
                read_up_to = p.total;
                for n in cursor.done() + 1..=p.total {
                    cursor.delivered(n);
                }
                continue;
            }
        }
        let size = outgoing.front().map_or(0, Record::size);
        tokio::select! {
            biased;
            Some(r) = reports.next() => {
                let (n, is_copy) = r.token;
                match r.result {
                    Ok(_) => {
                        dead_lettered += u64::from(is_copy);
                        cursor.delivered(n);
                    }
                    Err(error) => {
                        let copy = if is_copy { None } else { plan.settings.dead_letters.refused(&error, r.returned, p.consistent_point, (n, true)) };
                        match copy {
                            Some(copy) => {
                                tracing::warn!(%error, row = n, dead_letter_topic = %copy.topic, "dead-lettering the backfill row the broker refused");
                                outgoing.push_front(copy);
                            }
                            None => {
                                let resume_after = cursor.done();
                                let _ = store::save(control, plan.slot, resume_after).await;
                                return Err(BackfillError::Delivery { n, error, resume_after });
                            }
                        }
                    }
                }
            }
            permit = sink.reserve(size), if !outgoing.is_empty() => {
                if let Some(record) = outgoing.pop_front() {
                    sink.send(permit, record).await;
                }
            }
            _ = save.tick() => {
                if cursor.done() > saved {
                    store::save(control, plan.slot, cursor.done()).await?;
                    saved = cursor.done();
                }
            }
            _ = report.tick() => {
                let done = cursor.done();
                tracing::info!(
                    published = done,
                    total = p.total,
                    percent = format!("{:.1}", 100.0 * done as f64 / p.total.max(1) as f64),
                    "backfill progress"
                );
            }
        }
    }
    tracing::info!(
        slot = plan.slot,
        published = p.total - p.published,
        dead_lettered,
        elapsed = ?started.elapsed(),
        "backfill published"
    );
    drop(sink);
    Ok(Outcome::Published {
        total: p.total,
        published: p.total - p.published,
        dead_lettered,
        resumed,
    })
}

/// Turns copied rows into records, exactly as streamed rows.
struct Rows<'a> {
    mapping: &'a OutboxMapping,
    indexes: &'a ColumnIndexes,
    dead_letters: &'a DeadLetters,
    consistent_point: Lsn,
}

impl Rows<'_> {
    fn record(&self, n: u64, values: &[Option<String>]) -> Result<Record<Token>, BackfillError> {
        let tuple = TupleData::from_text(values.iter().map(|v| v.as_deref().map(str::as_bytes)))
            .ok_or(BackfillError::RowTooLarge(n))?;
        match self.mapping.map(self.indexes, &tuple) {
            Ok(event) => Ok(event.into_record((n, false))),
            Err(error) => {
                let topic = self.mapping.topic_of(self.indexes, &tuple);
                let event_id = self.mapping.event_id_of(self.indexes, &tuple);
                let payload = tuple.value_bytes(self.indexes.payload_index());
                let origin = Origin {
                    topic: topic.as_deref(),
                    lsn: self.consistent_point,
                    event_id: event_id.as_deref(),
                };
                match self
                    .dead_letters
                    .unmappable(&error, payload, origin, (n, true))
                {
                    Some(copy) => {
                        tracing::warn!(%error, row = n, dead_letter_topic = %copy.topic, "dead-lettering the backfill row that cannot be mapped");
                        Ok(copy)
                    }
                    None => Err(BackfillError::Unmappable { n, error }),
                }
            }
        }
    }
}
