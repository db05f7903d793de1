//! Where events come from: replication sessions on a slot.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use pgoutput_decoder::{
    Lsn, PgTimestamp, RelationBody, ReplicationMessage, StandbyStatusUpdate, TupleData,
};
use slot_manager::{
    check_server, connect_control, joined, pick_up, quote_ident, rows_before_joining,
    start_streaming, Coverage, CoverageReader, Joined, LogicalReplicationStream, OutboxTables,
    PickUp, ReplicationOptions, ShardFilter, TableName,
};
use tokio_postgres::Client;

use super::RunError;
use crate::config::Connection;
use crate::mapping::OutboxMapping;
use crate::quarantine::{HeldEvent, HeldKey, Step};
use crate::table_fit::check_fits;

/// Why a source or its stream failed: the seam's own error, which the
/// relay turns into a [`RunError`] (transient or definite as the error is).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// Postgres (connection, slot, preflight, a statement).
    #[error(transparent)]
    Postgres(#[from] slot_manager::Error),
    /// The slot has an unfinished backfill or heal: nothing may be streamed
    /// from it before its rows are published (an aggregate's new events
    /// would overtake its old ones).
    #[error("slot {slot:?} has an unfinished backfill or heal ({published} of {total} events published): streaming waits until it is done")]
    BackfillPending {
        /// The slot.
        slot: String,
        /// Rows published so far.
        published: u64,
        /// Rows in the backfill (0 before its snapshot was copied).
        total: u64,
    },
    /// The stream cannot hold events (a backfill's).
    #[error("this source cannot hold events in a quarantine")]
    NoQuarantine,
    /// Postgres did not answer in time.
    #[error("{what}: no answer from Postgres within {after:?}")]
    TimedOut {
        /// What waited.
        what: String,
        /// How long.
        after: std::time::Duration,
    },
    /// A backfill row too large for a record.
    #[error("backfill row {n} is too large to publish")]
    RowTooLarge {
        /// The row's number.
        n: u64,
    },
}

impl From<SourceError> for RunError {
    /// Postgres errors stay [`RunError::Postgres`], whose transient ones a
    /// new session cures; the others are [`RunError::Source`].
    fn from(e: SourceError) -> RunError {
        match e {
            SourceError::Postgres(e) => RunError::Postgres(e),
            SourceError::TimedOut { what, after } => RunError::TimedOut { what, after },
            other @ (SourceError::BackfillPending { .. }
            | SourceError::NoQuarantine
            | SourceError::RowTooLarge { .. }) => RunError::Source(other),
        }
    }
}

/// Opens replication sessions. The relay runs on one task, so these futures
/// need not be `Send`.
#[allow(async_fn_in_trait)]
pub trait Source {
    /// One session's stream.
    type Stream: ReplicationStream;

    /// Checks the server, starts streaming from the slot's confirmed
    /// position, and returns the stream and that position.
    async fn start(&mut self) -> Result<Started<Self::Stream>, SourceError>;
}

/// A session just started.
#[derive(Debug)]
pub struct Started<S> {
    /// Its stream.
    pub stream: S,
    /// The slot's confirmed position: where the stream starts.
    pub confirmed: Lsn,
    /// The server's history (system identifier and timeline): LSNs of two
    /// sessions compare only when it is the same.
    pub history: String,
    /// The server's WAL flush position as the session started
    /// (`IDENTIFY_SYSTEM`'s `xlogpos`). Everything walbox ever read from
    /// this history lies below it, so a delivered or recorded position past
    /// it means the WAL went backwards: a restore that kept the system
    /// identifier and timeline, a history of its own.
    pub server_wal: Lsn,
    /// The base type of each domain type among the outbox table's columns.
    pub domains: HashMap<u32, u32>,
}

/// What a stream yields to the relay's core.
#[derive(Debug)]
pub enum Input {
    /// A replication message: XLogData or a keepalive.
    Message(ReplicationMessage),
    /// The outbox table's columns as the catalog has them, for the rows
    /// that follow (a backfill's stream: it has no Relation messages).
    Relation(RelationBody),
    /// A row copied out of the outbox table (a backfill's stream).
    Row(CopiedRow),
    /// Nothing more will come: the session delivers what it read, confirms
    /// it and ends.
    End,
}

/// A row of the outbox table read with SQL, not from the WAL.
#[derive(Debug)]
pub struct CopiedRow {
    /// Its number in publishing order, from 1: the position the status
    /// updates of its stream confirm.
    pub n: u64,
    /// The OID of the [`Input::Relation`] that describes it.
    pub relation: u32,
    /// Its values, in the relation's column order.
    pub tuple: TupleData,
    /// The WAL position it is reported at (in logs and dead-letter
    /// headers): for a backfill, the slot's consistent point, which it
    /// committed before.
    pub lsn: Lsn,
}

/// One session's stream: a replication session, or a backfill's rows.
#[allow(async_fn_in_trait)]
pub trait ReplicationStream {
    /// The next input. Cancel-safe.
    async fn next(&mut self) -> Result<Input, SourceError>;

    /// Sends a standby status update (moves the slot's confirmed position;
    /// a backfill's stream saves its cursor).
    async fn send_status(&mut self, update: StandbyStatusUpdate) -> Result<(), SourceError>;

    /// What the publication publishes of the outbox table now (a catalog
    /// read on another connection).
    async fn coverage(&mut self) -> Result<Coverage, SourceError>;

    /// The slot's state, for the metrics; `None` if unknown.
    async fn slot_sample(&mut self) -> Option<slot_manager::SlotStatus>;

    /// Saves the delivered position and the commit time of the newest
    /// transaction below it, where a restart finds them.
    async fn save_position(
        &mut self,
        delivered: Lsn,
        committed: PgTimestamp,
    ) -> Result<(), SourceError>;

    /// Carries out a quarantine step (see [`crate::quarantine`]) on
    /// walbox's tables; `events` are those to write for [`Step::Write`].
    async fn quarantine(&mut self, step: &Step, events: &[HeldEvent]) -> Result<Done, SourceError> {
        let _ = (step, events);
        Err(SourceError::NoQuarantine)
    }

    /// Ends the session cleanly.
    async fn close(self);
}

/// What a quarantine step did.
#[derive(Debug)]
pub enum Done {
    /// Events written ([`Step::Write`]): how many were not held before.
    Written(u64),
    /// Every held aggregate and the number of held events ([`Step::Sync`]).
    Synced(Vec<HeldKey>, u64),
    /// The requests ([`Step::Poll`]).
    Polled(Vec<HeldKey>),
    /// Held events read ([`Step::Load`]).
    Loaded(Vec<HeldEvent>),
    /// Events deleted ([`Step::Released`], [`Step::Forget`]).
    Deleted(u64),
    /// A failed release recorded.
    Recorded,
}

/// The production source: a Postgres slot through slot-manager.
#[derive(Debug)]
pub struct PostgresSource {
    /// Where Postgres is and what to stream (one shard's, when sharded).
    connection: Connection,
    /// The mapping each table must fit, checked at every session's start
    /// (when rows are events).
    mapping: Arc<OutboxMapping>,
    options: ReplicationOptions,
}

impl PostgresSource {
    /// Streams `connection`'s slot through its publication; every session
    /// first checks that each table fits `mapping` (when its rows are
    /// events: [`check_fits`]), and asks for logical decoding messages when they
    /// are. A sharded connection names its shard, whose publication holds
    /// the shard's row filter.
    pub fn new(connection: Connection, mapping: &OutboxMapping) -> Self {
        let mut options = ReplicationOptions::new(connection.publication.clone());
        options.messages = connection.source.messages();
        PostgresSource {
            connection,
            mapping: Arc::new(mapping.clone()),
            options,
        }
    }
}

/// A session on Postgres: the replication stream, and a control connection
/// to sample the slot.
#[derive(Debug)]
pub struct PostgresStream {
    stream: LogicalReplicationStream,
    control: Client,
    slot: String,
    publication: String,
    /// The outbox tables, when their rows are events.
    tables: Option<OutboxTables>,
    /// The mapping a table must fit (for one picked up).
    mapping: Arc<OutboxMapping>,
    /// With several tables: those this session has seen published. One of
    /// them that leaves the publication while it still exists is drift, not
    /// a new table to pick up.
    seen: HashSet<TableName>,
    /// With several tables, whether this session's first reading was
    /// taken: that one looks for tables published while no walbox watched.
    first_read: bool,
    /// Whether a failed write of `walbox.published_tables` was said.
    record_failure_said: bool,
    shard: Option<ShardFilter>,
    /// The coverage statements, prepared on the control connection.
    coverage: CoverageReader,
}

impl PostgresSource {
    /// Refuses to stream while the slot has an unfinished backfill or heal.
    async fn check_no_backfill(&self, control: &Client) -> Result<(), SourceError> {
        let slot = &self.connection.slot;
        match crate::bookkeeping::backfills::unfinished(control, slot).await? {
            Some((published, total)) => Err(SourceError::BackfillPending {
                slot: slot.clone(),
                published,
                total,
            }),
            None => Ok(()),
        }
    }
}

impl Source for PostgresSource {
    type Stream = PostgresStream;

    async fn start(&mut self) -> Result<Started<PostgresStream>, SourceError> {
        let c = &self.connection;
        let control = connect_control(&c.pg).await?;
        let (least, why) = c.least_server();
        check_server(&control, least, why).await?;
        // The tables found now (a pattern may find more later: each is
        // checked as it is picked up).
        let tables = if c.source.table() {
            c.tables.resolve(&control).await?
        } else {
            Vec::new()
        };
        let mut domains = HashMap::new();
        for table in &tables {
            domains.extend(check_fits(&control, table, &self.mapping).await?);
        }
        self.check_no_backfill(&control).await?;
        crate::testpoint::reached("stream.checked").await;
        let started = start_streaming(&c.pg, &control, &c.slot, Lsn::ZERO, &self.options).await?;
        // Again now that this session holds the slot: another instance may
        // have begun a heal between the check above and START_REPLICATION
        // (it records the heal before it drops and remakes the slot, so a
        // slot this session could start on has its record visible now).
        // Nothing was confirmed yet.
        if let Err(e) = self.check_no_backfill(&control).await {
            started.stream.close().await;
            return Err(e);
        }
        Ok(Started {
            stream: PostgresStream {
                stream: started.stream,
                control,
                slot: c.slot.clone(),
                publication: c.publication.clone(),
                tables: c.source.table().then(|| c.tables.clone()),
                mapping: Arc::clone(&self.mapping),
                seen: HashSet::new(),
                first_read: false,
                record_failure_said: false,
                shard: c.shard.clone(),
                coverage: CoverageReader::default(),
            },
            confirmed: started.slot.confirmed_flush_lsn.unwrap_or(Lsn::ZERO),
            history: format!(
                "system {} timeline {}",
                started.system.system_id, started.system.timeline
            ),
            server_wal: started.system.xlogpos,
            domains,
        })
    }
}

impl PostgresStream {
    /// The coverage of several tables: a matching table outside the
    /// publication is picked up if it never held a row, else it is a gap;
    /// one that left the publication while it exists is drift.
    async fn coverage_of_several(&mut self) -> Result<Coverage, SourceError> {
        let outbox = self.tables.clone().expect("several tables");
        let (found, published) = outbox
            .resolve_with_published(&mut self.control, &self.publication)
            .await?;
        let p = quote_ident(&self.publication);
        let mut picked = Vec::new();
        let mut gap = None;
        for table in found.iter().filter(|t| !published.contains(t)) {
            if self.seen.contains(table) {
                gap = Some(format!(
                    "table {table} left publication {} while walbox ran: add it back and re-insert its rows in one transaction (BEGIN; ALTER PUBLICATION {p} ADD TABLE {table}; WITH moved AS (DELETE FROM {table} RETURNING *) INSERT INTO {table} SELECT * FROM moved; COMMIT): the rows written while it was out never entered the stream, and walbox cannot tell them from the rest (those delivered before arrive again; consumers deduplicate by event id)",
                    self.publication
                ));
                break;
            }
            if let Err(e) = check_fits(&self.control, table, &self.mapping).await {
                gap = Some(format!(
                    "table {table} matches the outbox tables, and cannot be streamed: {e}"
                ));
                break;
            }
            match pick_up(&mut self.control, &self.publication, table).await? {
                PickUp::Added => {
                    tracing::info!(%table, publication = %self.publication, "picked up a new outbox table: added to the publication (it never held a row)");
                    picked.push(table.clone());
                }
                PickUp::Written { bytes, inserts } => {
                    gap = Some(format!(
                        "table {table} matches the outbox tables and is not in publication {}, and it has held rows ({inserts} inserted, {bytes} bytes on disk) that the stream never carried: walbox adds a table only while it has never held one. Add it (ALTER PUBLICATION {p} ADD TABLE {table}), re-insert its rows so that they stream (WITH moved AS (DELETE FROM {table} RETURNING *) INSERT INTO {table} SELECT * FROM moved)",
                        self.publication
                    ));
                    break;
                }
                PickUp::Busy => {
                    tracing::info!(%table, "a new outbox table is being written to: picking it up at the next reading");
                }
            }
        }
        // A table published since this session last looked, by someone
        // else: safe only if it holds no row from before it joined (as one
        // created and published in one transaction). At the session's
        // start every table is new to it: those whose joining walbox did
        // not record (they joined while no walbox watched) are examined.
        let unseen: Vec<TableName> = published
            .iter()
            .filter(|t| !self.seen.contains(*t))
            .cloned()
            .collect();
        let entries = joined(&self.control, &self.publication, &unseen).await?;
        let first = !std::mem::replace(&mut self.first_read, true);
        let (examine, mut record): (Vec<Joined>, Vec<Joined>) = match first {
            false => (entries, Vec::new()),
            true => match self.recorded().await {
                // No record yet: the tables published now are the baseline.
                None => (Vec::new(), entries),
                Some(known) => entries.into_iter().partition(|e| {
                    !known
                        .iter()
                        .any(|(oid, xid)| *oid == e.oid && *xid == e.xid)
                }),
            },
        };
        let mut joined_clean = Vec::new();
        for entry in examine {
            match rows_before_joining(&self.control, &entry).await? {
                Some(e) => {
                    if gap.is_none() {
                        gap = Some(self.joined_with_rows(&e));
                    }
                }
                None => {
                    joined_clean.push(entry.table.clone());
                    record.push(entry);
                }
            }
        }
        record.extend(joined(&self.control, &self.publication, &picked).await?);
        if first || !record.is_empty() {
            self.record(&record).await;
        }
        let mut tables: Vec<TableName> = published;
        tables.extend(picked.iter().cloned());
        tables.sort();
        self.seen.extend(tables.iter().cloned());
        let mut reading = self
            .coverage
            .read_tables(&self.control, &self.publication, &tables)
            .await?;
        reading.added = picked.into_iter().chain(joined_clean).collect();
        if reading.gap.is_none() {
            reading.gap = gap;
        }
        Ok(reading)
    }

    /// The joinings recorded for the slot (see
    /// [`crate::bookkeeping::joined`]); `None` without a record, or when it
    /// cannot be read (said once: the start is then unchecked).
    async fn recorded(&mut self) -> Option<Vec<(u32, String)>> {
        match crate::bookkeeping::joined::load(&self.control, &self.slot).await {
            Ok(known) => known,
            Err(e) => {
                self.record_failed(&e);
                None
            }
        }
    }

    /// Records `entries` as known published (and the baseline mark).
    async fn record(&mut self, entries: &[Joined]) {
        if let Err(e) = crate::bookkeeping::joined::record(&self.control, &self.slot, entries).await
        {
            self.record_failed(&e);
        }
    }

    fn record_failed(&mut self, e: &slot_manager::Error) {
        if !std::mem::replace(&mut self.record_failure_said, true) {
            tracing::warn!(error = %e, slot = %self.slot, "cannot keep walbox.published_tables: a table added to the publication by hand while walbox is stopped goes unchecked at the next start (grant walbox's role CREATE on the database, or create the schema walbox for it)");
        }
    }

    /// The gap a table makes that holds rows from before it joined the
    /// publication, with the fix.
    fn joined_with_rows(&self, e: &slot_manager::EarlierRows) -> String {
        format!(
            "table {} joined publication {} by someone else's ALTER PUBLICATION (not picked up by walbox), and holds {} inserted before it joined, which the stream never carried: re-insert them so that they stream ({}); any of them delivered during an earlier membership of the table arrives again (consumers deduplicate by event id)",
            e.table,
            self.publication,
            e.count(),
            e.fix()
        )
    }
}

impl ReplicationStream for PostgresStream {
    async fn next(&mut self) -> Result<Input, SourceError> {
        Ok(Input::Message(self.stream.next_message().await?))
    }

    async fn send_status(&mut self, mut update: StandbyStatusUpdate) -> Result<(), SourceError> {
        // The client's clock as the update leaves (the core reads none).
        update.client_time = PgTimestamp::now();
        Ok(self.stream.send_standby_status_update(update).await?)
    }

    async fn coverage(&mut self) -> Result<Coverage, SourceError> {
        let single = match &self.tables {
            None => None,
            Some(tables) => match tables.single() {
                Some(table) => Some(table.clone()),
                None => return self.coverage_of_several().await,
            },
        };
        Ok(self
            .coverage
            .read(
                &self.control,
                &self.publication,
                single.as_ref(),
                self.shard.as_ref(),
            )
            .await?)
    }

    async fn slot_sample(&mut self) -> Option<slot_manager::SlotStatus> {
        // Metrics only: a failed or slow sample is not worth stopping for.
        let sample = slot_manager::slot_status(&self.control, &self.slot);
        match tokio::time::timeout(std::time::Duration::from_secs(5), sample).await {
            Ok(Ok(status)) => status,
            _ => None,
        }
    }

    async fn save_position(
        &mut self,
        delivered: Lsn,
        committed: PgTimestamp,
    ) -> Result<(), SourceError> {
        let save =
            crate::bookkeeping::positions::save(&self.control, &self.slot, delivered, committed);
        let after = std::time::Duration::from_secs(5);
        match tokio::time::timeout(after, save).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(SourceError::TimedOut {
                what: "saving the delivered position".into(),
                after,
            }),
        }
    }

    async fn quarantine(&mut self, step: &Step, events: &[HeldEvent]) -> Result<Done, SourceError> {
        use crate::bookkeeping::quarantine as q;
        let (client, slot) = (&mut self.control, self.slot.as_str());
        let work = async move {
            Ok::<_, slot_manager::Error>(match step {
                Step::Write => {
                    q::ensure(client).await?;
                    Done::Written(q::hold(client, slot, events).await?)
                }
                Step::Sync => {
                    let (keys, events) = q::held(client, slot).await?;
                    Done::Synced(keys, events)
                }
                Step::Poll => Done::Polled(q::requests(client, slot).await?),
                Step::Load { key, after } => {
                    use crate::quarantine::{RELEASE_BATCH, RELEASE_BATCH_BYTES};
                    let batch = q::load(
                        client,
                        slot,
                        key,
                        *after,
                        RELEASE_BATCH,
                        RELEASE_BATCH_BYTES,
                    );
                    Done::Loaded(batch.await?)
                }
                Step::Released { key, through } => {
                    Done::Deleted(q::released(client, slot, key, *through).await?)
                }
                Step::Forget { key } => Done::Deleted(q::forget_key(client, slot, key).await?),
                Step::ReleaseFailed { key, error } => {
                    q::release_failed(client, slot, key, error).await?;
                    Done::Recorded
                }
            })
        };
        match tokio::time::timeout(QUARANTINE_TIMEOUT, work).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(SourceError::TimedOut {
                what: "the quarantine's tables".into(),
                after: QUARANTINE_TIMEOUT,
            }),
        }
    }

    async fn close(self) {
        self.stream.close().await;
    }
}

/// How long a statement on the quarantine's tables may take before the
/// session is deemed broken (a new one starts; nothing was confirmed past
/// what is not held yet).
const QUARANTINE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
