//! Replication messages: what each one does to the progress, the queued
//! records and the metrics. Rows and event messages are mapped here (or
//! dead-lettered, or stop the relay).

use std::sync::Arc;

use pgoutput_decoder::{
    LogicalMessage, Lsn, PgTimestamp, RelationBody, ReplicationMessage, TupleData,
};
use sink_core::Record;
use tokio::time::Instant;

use super::quarantine::Why;
use super::{Core, Mode, Observation};
use crate::dead_letter::{DeadLetterKind, Origin};
use crate::mapping::{ColumnIndexes, MapError, MappedEvent};
use crate::quarantine::QuarantineError;
use crate::relay::{Carries, CopiedRow, RunError, Token};

/// Postgres' first OID for objects made after `initdb` (FirstNormalObjectId):
/// a type at or past it is a user's (a domain, an enum), which the session
/// resolves from the catalog when it starts.
const FIRST_USER_OID: u32 = 16_384;

/// What is known of an event that cannot be mapped, for its dead-letter copy.
#[derive(Default)]
struct Unmapped {
    /// The topic it was meant for, if it named one.
    topic: Option<String>,
    /// Its record key, if its aggregate id can be read.
    key: Option<bytes::Bytes>,
    event_id: Option<String>,
    /// The payload (a row's) or the whole envelope (a message's).
    payload: Option<bytes::Bytes>,
}

impl Core<'_> {
    /// Handles one frame received at `now` (`wall` on the wall clock).
    pub(in crate::relay) fn on_message(
        &mut self,
        message: ReplicationMessage,
        now: Instant,
        wall: PgTimestamp,
    ) -> Result<(), RunError> {
        let xlog = match message {
            ReplicationMessage::PrimaryKeepalive(k) => {
                let update = self
                    .progress
                    .keepalive(k.wal_end(), k.reply_requested(), now);
                self.effects.status(update);
                return Ok(());
            }
            ReplicationMessage::XLogData(x) => x,
            _ => return Ok(()),
        };
        self.progress.received(xlog.wal_end());
        self.frame_at = Some(now);
        let lsn = xlog.wal_start();
        match self.decoder.decode(xlog.into_data())? {
            LogicalMessage::Begin(b) => {
                self.progress.begin_at(b.final_lsn(), b.commit_time())?;
                self.commit_time = b.commit_time();
                self.queued_in_transaction = 0;
                match &mut self.mode {
                    Mode::AtLeastOnce { next_index } => *next_index = 0,
                    Mode::ExactlyOnce(t) => t.begin(b.final_lsn()),
                }
            }
            LogicalMessage::Commit(c) => {
                if self.queued_in_transaction > 0 {
                    // One observation per transaction, counted per event.
                    self.effects.observe(Observation::Read {
                        events: self.queued_in_transaction,
                        micros: wall.as_unix_micros() - self.commit_time.as_unix_micros(),
                    });
                    self.queued_in_transaction = 0;
                }
                if let Some(t) = self.mode.transactions_mut() {
                    t.commit(c.commit_lsn());
                }
                let update = self.progress.commit(c.commit_lsn(), c.end_lsn(), now)?;
                self.effects.status(update);
                return Ok(());
            }
            LogicalMessage::Relation(r) => self.on_relation(&r),
            LogicalMessage::Insert(insert) => {
                let Some(columns) = self.outbox.get(&insert.relation_oid()) else {
                    return Ok(()); // another table (publication changed by hand)
                };
                if !self.config.source.table() {
                    return Ok(()); // source = messages: rows are not events
                }
                let columns = Arc::clone(columns);
                self.on_insert(&columns, insert.tuple(), lsn)?;
            }
            LogicalMessage::Message(m) => {
                if !self.config.source.messages() || m.prefix() != self.config.message_prefix {
                    return Ok(()); // another application's message
                }
                if !m.transactional() {
                    // Sent at once, whether its transaction commits or not:
                    // not an event. Said once per process, counted always.
                    let first = !self.nontransactional_reported;
                    self.nontransactional_reported = true;
                    self.effects.observe(Observation::NonTransactional {
                        lsn,
                        prefix: m.prefix().to_owned(),
                        first,
                    });
                    return Ok(());
                }
                self.on_event_message(m.content(), lsn)?;
            }
            // Only INSERTs are events; the app may delete rows freely.
            LogicalMessage::Update(_)
            | LogicalMessage::Delete(_)
            | LogicalMessage::Truncate(_)
            | LogicalMessage::Type(_)
            | LogicalMessage::Origin(_) => {}
            other => return Err(RunError::Unexpected(other.tag() as char)),
        }
        Ok(())
    }

    /// A relation's description. The outbox is the configured name or the
    /// table's OID: a replay may carry the table under an earlier name, or
    /// an earlier table of the same name. The message describes the tuples
    /// that follow it, so the mapping is resolved again from it every time
    /// (a column dropped, a table renamed: never a stale column position).
    pub(in crate::relay) fn on_relation(&mut self, r: &RelationBody) {
        let named = self.config.tables.matches(r.namespace(), r.name());
        let current = self.coverage.as_ref().is_some_and(|c| {
            c.table_oid == Some(r.oid()) || c.tables.iter().any(|t| t.oid == Some(r.oid()))
        });
        if named || current || self.outbox.contains_key(&r.oid()) {
            if !named {
                self.effects.observe(Observation::Renamed {
                    oid: r.oid(),
                    name: format!("{}.{}", r.namespace(), r.name()),
                });
            }
            let resolved = self.config.mapping.resolve_with(r, &self.domains);
            self.outbox.insert(r.oid(), Arc::new(resolved));
        }
    }

    /// A row copied out of the outbox table (a backfill): one event in a
    /// transaction of its own at position `row.n`, mapped, dead-lettered or
    /// refused exactly as a streamed row.
    pub(in crate::relay) fn on_row(
        &mut self,
        row: CopiedRow,
        now: Instant,
    ) -> Result<(), RunError> {
        let at = Lsn::from(row.n);
        let columns = self
            .outbox
            .get(&row.relation)
            .map(Arc::clone)
            .expect("a backfill's stream describes its relation before its rows");
        self.progress.received(at);
        self.frame_at = None;
        self.progress.begin_at(at, PgTimestamp::default())?;
        self.commit_time = PgTimestamp::default();
        if let Mode::AtLeastOnce { next_index } = &mut self.mode {
            *next_index = 0;
        }
        self.on_insert(&columns, &row.tuple, row.lsn)?;
        let update = self.progress.commit(at, at, now)?;
        self.effects.status(update);
        Ok(())
    }

    /// Maps an inserted row and queues its record (or its dead-letter
    /// copy). `columns` is the mapping resolved for its relation, or why the
    /// relation cannot be mapped (then every row of it is unmappable).
    fn on_insert(
        &mut self,
        columns: &Result<ColumnIndexes, MapError>,
        tuple: &TupleData,
        lsn: Lsn,
    ) -> Result<(), RunError> {
        if self.skip_replayed() {
            return Ok(());
        }
        let columns = match columns {
            Ok(columns) => {
                columns.check_width(tuple)?;
                columns
            }
            Err(MapError::PayloadType {
                table, type_oid, ..
            }) if *type_oid >= FIRST_USER_OID && !self.domains.contains_key(type_oid) => {
                return Err(RunError::UnresolvedType {
                    table: table.clone(),
                    type_oid: *type_oid,
                })
            }
            Err(e) => return self.on_unmappable(e.clone(), Unmapped::default(), lsn),
        };
        match self
            .config
            .mapping
            .map_with(columns, tuple, &mut self.topics)
        {
            Ok(event) => self.queue(event, lsn),
            Err(e) => {
                let mapping = &self.config.mapping;
                let unmapped = Unmapped {
                    topic: mapping.topic_of(columns, tuple),
                    key: mapping.key_of(columns, tuple),
                    event_id: mapping.event_id_of(columns, tuple),
                    payload: tuple.value_bytes(columns.payload_index()),
                };
                self.on_unmappable(e, unmapped, lsn)
            }
        }
    }

    /// An event message's envelope: mapped and queued like a row, or
    /// dead-lettered whole.
    fn on_event_message(&mut self, content: &bytes::Bytes, lsn: Lsn) -> Result<(), RunError> {
        if self.skip_replayed() {
            return Ok(());
        }
        match crate::mapping::envelope::map(&self.config.mapping, content, lsn, &mut self.topics) {
            Ok(event) => self.queue(event, lsn),
            Err(e) => {
                let unmapped = Unmapped {
                    topic: None,
                    key: None,
                    event_id: crate::mapping::envelope::event_id_of(content),
                    payload: Some(content.clone()),
                };
                self.on_unmappable(e, unmapped, lsn)
            }
        }
    }

    /// True when the next event of the open transaction is one a replay
    /// re-sent and Kafka has already (exactly-once: counted first, whether
    /// skipped or not, since the count is the event's index).
    fn skip_replayed(&mut self) -> bool {
        let in_kafka = self
            .mode
            .transactions_mut()
            .is_some_and(|t| t.next_row_skipped());
        if in_kafka || self.progress.replaying() {
            self.effects.observe(Observation::ReplaySkipped);
            return true;
        }
        false
    }

    /// Queues a mapped event's record (or, when the broker refused it for
    /// good before, its dead-letter copy).
    fn queue(&mut self, mut event: MappedEvent, lsn: Lsn) -> Result<(), RunError> {
        self.queued_in_transaction += 1;
        if let Some(error) = self
            .mode
            .transactions()
            .and_then(|t| t.refusal(lsn, t.current_index()))
        {
            // Refused for good before: straight to the dead-letter topic.
            let token = self.token(Arc::clone(&event.topic), lsn, Some(DeadLetterKind::Refused))?;
            let topic = Arc::clone(&event.topic);
            let returned = event.into_record(());
            if let Some(record) =
                self.config
                    .dead_letters
                    .refused(&error, Some(returned), lsn, token)
            {
                self.effects.observe(Observation::DeadLettering {
                    why: "dead-lettering the event the broker refused",
                    error: error.to_string(),
                    topic: Some(topic),
                    lsn,
                    dead_letter_topic: Arc::clone(&record.topic),
                });
                self.outgoing.push_back(record);
                return Ok(());
            }
            return Err(RunError::Delivery(error));
        }
        if self.holds(&event.key) {
            let token = self.token(Arc::clone(&event.topic), lsn, None)?;
            return self.hold(event.into_record(()), token, Why::Behind);
        }
        let mut token = self.token(Arc::clone(&event.topic), lsn, None)?;
        // Decided as the event is mapped: its span's ids (written into its
        // `traceparent`), and whether the audit asked for this one. Ending
        // the span and noting the sample are observations.
        let span = self.config.spans.as_ref().and_then(|s| s.begin(&mut event));
        let sampled = self.config.audit.as_ref().is_some_and(|tap| tap.take());
        if sampled || self.config.receipts.is_some() {
            token.event_id = Some(event.event_id.as_str().into());
        }
        token.carries = Carries::Event {
            span,
            sampled,
            serialized: false,
        };
        self.outgoing.push_back(event.into_record(token));
        Ok(())
    }

    /// An event that cannot be mapped: its dead-letter copy, or stop.
    fn on_unmappable(
        &mut self,
        e: MapError,
        Unmapped {
            topic,
            key,
            event_id,
            payload,
        }: Unmapped,
        lsn: Lsn,
    ) -> Result<(), RunError> {
        if self.quarantines() {
            let (Some(topic), Some(key)) = (topic, key) else {
                self.effects.observe(Observation::Stopping {
                    what: "cannot map an outbox row, nor hold it",
                    error: e.to_string(),
                    lsn,
                });
                return Err(QuarantineError::NoKey(e.to_string()).into());
            };
            let token = self.token(Arc::from(topic.as_str()), lsn, None)?;
            let mut record = Record::new(topic, Some(key), payload, ());
            if let Some(id) = event_id {
                record = record.with_header("id", id);
            }
            let error = e.to_string();
            return self.hold(record, token, Why::Unmappable(&error));
        }
        let mut token = self.token(
            Arc::from(topic.as_deref().unwrap_or("")),
            lsn,
            Some(DeadLetterKind::Unmappable),
        )?;
        if self.config.receipts.is_some() {
            token.event_id = event_id.as_deref().map(Into::into);
        }
        let origin = Origin {
            topic: topic.as_deref(),
            lsn,
            event_id: event_id.as_deref(),
        };
        match self
            .config
            .dead_letters
            .unmappable(&e, payload, origin, token)
        {
            Some(record) => {
                self.effects.observe(Observation::DeadLettering {
                    why: "unmappable row sent to the dead-letter topic",
                    error: e.to_string(),
                    topic: None,
                    lsn,
                    dead_letter_topic: Arc::clone(&record.topic),
                });
                self.outgoing.push_back(record);
                Ok(())
            }
            None => {
                self.effects.observe(Observation::Stopping {
                    what: "cannot map an outbox row",
                    error: e.to_string(),
                    lsn,
                });
                Err(RunError::Map(e))
            }
        }
    }

    /// The token for an event of the open transaction meant for `topic`.
    fn token(
        &mut self,
        topic: Arc<str>,
        lsn: Lsn,
        dead_letter: Option<DeadLetterKind>,
    ) -> Result<Token, RunError> {
        let event = self.progress.event()?;
        Ok(Token {
            event,
            lsn,
            // `event` succeeded: a transaction is open.
            commit_lsn: self.progress.open_transaction().unwrap_or_default(),
            index: self.next_index(),
            commit_time: self.commit_time,
            topic,
            event_id: None,
            read: self.frame_at,
            sent: None,
            carries: match dead_letter {
                Some(kind) => Carries::DeadLetter(kind),
                None => Carries::Event {
                    span: None,
                    sampled: false,
                    serialized: false,
                },
            },
        })
    }
}
