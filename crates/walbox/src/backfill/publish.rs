//! Publishing the copied rows: they are a second source of the relay, fed
//! to the same core as streamed rows ([`crate::relay::run_once`]), so one
//! path maps them, bounds what is in flight, dead-letters what cannot be
//! delivered and decides what counts as delivered.
//!
//! The rows' stream yields the outbox table's relation (from the catalog),
//! then the rows after the saved cursor in publishing order, read
//! [`BATCH`] at a time, then [`Input::End`]. Row `n` stands at position
//! `n`: the core's status updates confirm the last row delivered with every
//! row before it, and the stream saves that as the cursor (as it moves, at
//! most every 50 ms). A rerun after a crash resumes after it.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pgoutput_decoder::{Lsn, PgTimestamp, RelationBody, StandbyStatusUpdate, TupleData};
use slot_manager::{domain_base_types, ChangeInFlight, Coverage};
use tokio_postgres::Client;

use super::{BackfillError, Outcome, Plan, BATCH, REPORT_EVERY, SAVE_EVERY};
use crate::bookkeeping::backfills::{self as store, Publishing};
use crate::broker::{Broker, Patience};
use crate::config::EventSource;
use crate::metrics::Metrics;
use crate::relay::{
    CopiedRow, Ends, Input, RelayConfig, ReplicationStream, RunError, Source, SourceError, Started,
    Token,
};

/// The OID the rows' relation goes by (the catalog's is not needed).
const RELATION: u32 = 0;

/// Publishes rows after `p.published`, saving the cursor as deliveries
/// arrive.
pub(super) async fn publish(
    plan: Plan<'_>,
    control: &Client,
    p: &Publishing,
    resumed: bool,
) -> Result<Outcome, BackfillError> {
    let relation = RelationBody::from_catalog(
        RELATION,
        plan.table.schema(),
        plan.table.name(),
        p.columns.iter().cloned(),
    );
    let domains = domain_base_types(control, plan.table).await?;
    // A table that cannot be mapped at all is one error before anything is
    // sent, not one per row.
    plan.mapping
        .resolve_with(&relation, &domains)
        .map_err(BackfillError::Mapping)?;
    // The one place rows are republished: to the configured broker, not
    // in a Kafka transaction (see the module's documentation).
    let metrics = Metrics::new();
    let settings = plan.settings.sink.without_transactions();
    let Some((broker, mut reports)) =
        Broker::<Token>::connect(&settings, Patience::Once, &metrics).await?
    else {
        unreachable!("a connection that waits once never sees a signal");
    };

    let config = RelayConfig {
        // Row `n` stands at position `n` of a stream of its own: on SQS
        // FIFO its deduplication id never meets the slot's.
        stream: Arc::from(format!("{}+{}", plan.slot, p.consistent_point).as_str()),
        tables: slot_manager::OutboxTables::one(plan.table.clone()),
        mapping: plan.mapping.clone(),
        source: EventSource::Table,
        message_prefix: String::new(),
        dead_letters: plan.settings.dead_letters.clone(),
        // A backfill's rows are not held: one that fails stops it (with
        // the quarantine on, as with stop).
        quarantine: None,
        status_interval: SAVE_EVERY,
        shutdown_timeout: Duration::ZERO,
        // A backfill's rows are a stream of their own, read from the table.
        skip_delivered: None,
        exactly_once: None,
        save_positions: false,
        spans: None,
        audit: None,
        receipts: None,
        claim_check: broker
            .claim_check(plan.settings.claim_check.as_ref())
            .map_err(RunError::from)?,
        schema_registry: plan
            .settings
            .schema_registry
            .as_ref()
            .map(crate::schema_registry::SchemaRegistry::new)
            .transpose()
            .map_err(RunError::from)?,
    };
    let saved = Rc::new(Cell::new(p.published));
    let mut rows = Rows {
        control,
        slot: plan.slot,
        publishing: p,
        relation: Some(relation),
        domains: Some(domains),
        saved: Rc::clone(&saved),
    };
    let started = Instant::now();
    let ran = crate::relay::run_once(
        &config,
        &mut rows,
        Ends::at_least_once(&broker),
        &mut reports,
        metrics,
    )
    .await;
    // Every record has its report (the session waited for them all).
    broker.close(reports, Duration::ZERO).await;
    let dead_lettered = match ran {
        Ok(finished) => finished.dead_lettered,
        Err(source) => {
            return Err(BackfillError::Stopped {
                resume_after: saved.get(),
                source: Box::new(source),
            })
        }
    };
    tracing::info!(
        slot = plan.slot,
        published = p.total - p.published,
        dead_lettered,
        elapsed = ?started.elapsed(),
        "backfill published"
    );
    Ok(Outcome::Published {
        total: p.total,
        published: p.total - p.published,
        dead_lettered,
        resumed,
    })
}

/// The copied rows as a source: one session, from the saved cursor.
struct Rows<'c> {
    control: &'c Client,
    slot: &'c str,
    publishing: &'c Publishing,
    relation: Option<RelationBody>,
    domains: Option<HashMap<u32, u32>>,
    /// The cursor last saved.
    saved: Rc<Cell<u64>>,
}

impl<'c> Source for Rows<'c> {
    type Stream = RowStream<'c>;

    async fn start(&mut self) -> Result<Started<RowStream<'c>>, SourceError> {
        let (Some(relation), Some(domains)) = (self.relation.take(), self.domains.take()) else {
            unreachable!("a backfill publishes in one session")
        };
        let p = self.publishing;
        Ok(Started {
            stream: RowStream {
                control: self.control,
                slot: self.slot,
                total: p.total,
                consistent_point: p.consistent_point,
                relation: Some(relation),
                buffered: VecDeque::new(),
                read_up_to: p.published,
                fetch: None,
                saved: Rc::clone(&self.saved),
                reported: Instant::now(),
            },
            confirmed: Lsn::from(p.published),
            history: format!("backfill of slot {}", self.slot),
            server_wal: Lsn::from(p.total),
            domains,
        })
    }
}

type Batch = Result<Vec<(u64, Vec<Option<String>>)>, slot_manager::Error>;

/// The rows after the cursor, [`BATCH`] at a time.
struct RowStream<'c> {
    control: &'c Client,
    slot: &'c str,
    total: u64,
    consistent_point: Lsn,
    /// Yielded first.
    relation: Option<RelationBody>,
    /// Rows read and not yielded yet.
    buffered: VecDeque<(u64, Vec<Option<String>>)>,
    /// The last row read.
    read_up_to: u64,
    /// The batch being read: kept across calls, so `next` is cancel-safe.
    fetch: Option<Pin<Box<dyn Future<Output = Batch> + 'c>>>,
    saved: Rc<Cell<u64>>,
    /// When progress was last logged.
    reported: Instant,
}

impl RowStream<'_> {
    /// Reads the batch being read, if any, into the buffer.
    async fn finish_fetch(&mut self) -> Result<(), SourceError> {
        let Some(fetch) = self.fetch.as_mut() else {
            return Ok(());
        };
        let batch = fetch.await;
        self.fetch = None;
        let batch = batch?;
        match batch.last() {
            Some((n, _)) => self.read_up_to = *n,
            // Fewer rows than recorded (deleted by hand): nothing more.
            None => self.read_up_to = self.total,
        }
        self.buffered.extend(batch);
        Ok(())
    }
}

impl ReplicationStream for RowStream<'_> {
    async fn next(&mut self) -> Result<Input, SourceError> {
        if let Some(relation) = self.relation.take() {
            return Ok(Input::Relation(relation));
        }
        if self.buffered.is_empty() && self.read_up_to < self.total {
            let (control, slot, after) = (self.control, self.slot, self.read_up_to);
            self.fetch
                .get_or_insert_with(|| Box::pin(store::rows_after(control, slot, after, BATCH)));
            self.finish_fetch().await?;
        }
        let Some((n, values)) = self.buffered.pop_front() else {
            return Ok(Input::End);
        };
        let tuple = TupleData::from_text(values.iter().map(|v| v.as_deref().map(str::as_bytes)))
            .ok_or(SourceError::RowTooLarge { n })?;
        Ok(Input::Row(CopiedRow {
            n,
            relation: RELATION,
            tuple,
            lsn: self.consistent_point,
        }))
    }

    /// Saves the cursor: every row up to `flush` was delivered.
    async fn send_status(&mut self, update: StandbyStatusUpdate) -> Result<(), SourceError> {
        let done = update.flush.as_u64();
        if done > self.saved.get() {
            // One statement at a time on the connection: the batch being
            // read first (tokio-postgres hands a statement's rows over as
            // they are read, so another statement's answer waits behind
            // them until they are taken).
            self.finish_fetch().await?;
            store::save(self.control, self.slot, done).await?;
            self.saved.set(done);
        }
        if self.reported.elapsed() >= REPORT_EVERY {
            self.reported = Instant::now();
            tracing::info!(
                published = done,
                total = self.total,
                percent = format!("{:.1}", 100.0 * done as f64 / self.total.max(1) as f64),
                "backfill progress"
            );
        }
        Ok(())
    }

    /// The rows are not the stream of a publication: nothing to verify.
    async fn coverage(&mut self) -> Result<Coverage, SourceError> {
        Ok(Coverage {
            wal_lsn: Lsn::from(self.total),
            table_oid: None,
            gap: None,
            fingerprint: "backfill".into(),
            in_flight: ChangeInFlight::Nothing,
            tables: Vec::new(),
            added: Vec::new(),
        })
    }

    async fn slot_sample(&mut self) -> Option<slot_manager::SlotStatus> {
        None
    }

    async fn save_position(&mut self, _: Lsn, _: PgTimestamp) -> Result<(), SourceError> {
        Ok(())
    }

    async fn close(self) {}
}
