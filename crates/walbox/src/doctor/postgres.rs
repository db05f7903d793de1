//! Postgres, as `walbox run` will find it: the server's settings, the
//! role's rights, the publication, each outbox table against its mapping,
//! and the slot (failover slots included). Facts are read in [`gather`];
//! every verdict is a plain function of them.

use std::time::Duration;

use slot_manager::{
    publication_tables, quote_ident, slot_status, SlotStatus, TableName, MAY_REPLICATE,
};
use tokio_postgres::Client;

use super::{bytes, Finding};
use crate::config::Connection;
use crate::mapping::OutboxMapping;

/// The server's settings and the role, read in one query.
#[derive(Clone, Debug, Default)]
pub struct Server {
    /// `server_version_num`.
    pub version_num: i32,
    /// `wal_level`.
    pub wal_level: String,
    /// `max_replication_slots`, and the slots that exist.
    pub max_slots: i64,
    /// Replication slots of any kind.
    pub slots_used: i64,
    /// `max_wal_senders`, and the walsenders running.
    pub max_senders: i64,
    /// Walsenders running.
    pub senders_used: i64,
    /// `max_slot_wal_keep_size` in MB; `-1` unlimited.
    pub max_slot_wal_keep_mb: i64,
    /// `idle_replication_slot_timeout` in seconds (Postgres 18+; 0 off).
    pub idle_slot_timeout_s: Option<i64>,
    /// `wal_sender_timeout` in ms (0 off).
    pub wal_sender_timeout_ms: i64,
    /// `synchronized_standby_slots` (Postgres 17+).
    pub synchronized_standby_slots: Option<String>,
    /// The role.
    pub role: String,
    /// Superuser.
    pub superuser: bool,
    /// The REPLICATION attribute, or a managed service's replication role.
    pub may_replicate: bool,
    /// The server is a standby.
    pub in_recovery: bool,
    /// `walbox.relay_state` (migration 0007): `None` when not installed,
    /// else whether the role may write it (report its backlog).
    pub reports_backlog: Option<bool>,
}

/// The publication, if it exists.
#[derive(Clone, Debug, Default)]
pub struct Publication {
    /// It publishes INSERTs.
    pub inserts: bool,
    /// `FOR ALL TABLES`.
    pub all_tables: bool,
    /// The role owns it (or is a member of its owner): walbox can add a
    /// new outbox table to it.
    pub owned: bool,
    /// The tables it publishes.
    pub tables: Vec<TableName>,
}

/// One outbox table.
#[derive(Clone, Debug)]
pub struct Table {
    /// Which.
    pub table: TableName,
    /// The role may SELECT it.
    pub selectable: bool,
    /// Why its rows cannot be mapped, if not.
    pub unfit: Option<String>,
    /// The largest payload, in bytes, as published (its text); `Err`: why
    /// it was not measured.
    pub largest_payload: Result<Option<i64>, String>,
    /// A sample of its aggregate types (the topic template's input).
    pub aggregate_types: Vec<String>,
}

/// Everything [`judge`] needs.
#[derive(Clone, Debug, Default)]
pub struct Facts {
    /// The server.
    pub server: Server,
    /// The database connected to.
    pub database: String,
    /// The publication; `None` when it does not exist.
    pub publication: Option<Publication>,
    /// The outbox tables found (empty when the source is messages only).
    pub tables: Vec<Table>,
    /// The configured tables that do not exist, as the refusal says.
    pub missing_tables: Option<String>,
    /// The slot; `None` when it does not exist (or the server is a
    /// standby: its slots are not walbox's to judge).
    pub slot: Option<SlotStatus>,
}

/// What else the verdicts weigh, from the configuration.
#[derive(Clone, Debug)]
pub struct Expected {
    /// The slot's name.
    pub slot: String,
    /// The publication's name.
    pub publication: String,
    /// The oldest server, and why.
    pub least_server: (i32, &'static str),
    /// The source streams outbox tables (not only messages).
    pub tables: bool,
    /// The configured tables, as written.
    pub tables_written: String,
    /// The status interval of `walbox run`.
    pub status_interval: Duration,
}

/// How long a measuring query (the largest payload, a sample of aggregate
/// types) may run: doctor must not load a primary for long.
const MEASURE_TIMEOUT: &str = "10s";

/// Rows sampled for aggregate types.
const SAMPLED_ROWS: i64 = 100_000;

/// At most this many aggregate types are kept per table.
pub const SAMPLED_TYPES: i64 = 20;

/// The outbox tables found, each measured: the same for every shard, so
/// read once.
#[derive(Clone, Debug, Default)]
pub struct Outbox {
    /// The tables found (none when the source is messages only).
    pub tables: Vec<Table>,
    /// The configured tables that do not exist, as the refusal says.
    pub missing: Option<String>,
}

/// Finds and measures the outbox tables (a scan of each, under
/// [`MEASURE_TIMEOUT`]).
pub async fn gather_outbox(
    client: &mut Client,
    c: &Connection,
    mapping: &OutboxMapping,
) -> Result<Outbox, slot_manager::Error> {
    let mut outbox = Outbox::default();
    if c.source.table() {
        match c.tables.resolve(&*client).await {
            Ok(found) => {
                for table in found {
                    outbox
                        .tables
                        .push(table_facts(client, &table, mapping).await?);
                }
            }
            Err(slot_manager::Error::Precondition(why)) => outbox.missing = Some(why),
            Err(e) => return Err(e),
        }
    }
    Ok(outbox)
}

/// Reads the facts of one slot (a shard's), with the outbox already read.
/// An error is one a query met (the connection lost, a right missing on
/// the catalog): the caller reports the checks unchecked.
pub async fn gather(
    client: &mut Client,
    c: &Connection,
    outbox: &Outbox,
) -> Result<Facts, slot_manager::Error> {
    let server = server(client).await?;
    let database: String = client
        .query_one("SELECT current_database()::text", &[])
        .await
        .map_err(slot_manager::Error::sql("read the database"))?
        .get(0);
    let publication = publication(client, &c.publication).await?;
    // On a standby (postgres.primary fails) the slot's WAL figures cannot
    // be read (pg_current_wal_lsn()).
    let slot = match server.in_recovery {
        true => None,
        false => slot_status(client, &c.slot).await?,
    };
    Ok(Facts {
        server,
        database,
        publication,
        tables: outbox.tables.clone(),
        missing_tables: outbox.missing.clone(),
        slot,
    })
}

async fn server(client: &Client) -> Result<Server, slot_manager::Error> {
    let row = client
        .query_one(
            &format!(
            "SELECT current_setting('server_version_num')::int,
                    current_setting('wal_level'),
                    current_setting('max_replication_slots')::int8,
                    (SELECT count(*) FROM pg_replication_slots),
                    current_setting('max_wal_senders')::int8,
                    (SELECT count(*) FROM pg_stat_replication),
                    (SELECT setting::int8 FROM pg_settings WHERE name = 'max_slot_wal_keep_size'),
                    (SELECT CASE unit WHEN 'min' THEN setting::int8 * 60 WHEN 'ms' THEN setting::int8 / 1000
                                      ELSE setting::int8 END
                       FROM pg_settings WHERE name = 'idle_replication_slot_timeout'),
                    (SELECT CASE unit WHEN 's' THEN setting::int8 * 1000 ELSE setting::int8 END
                       FROM pg_settings WHERE name = 'wal_sender_timeout'),
                    (SELECT setting FROM pg_settings WHERE name = 'synchronized_standby_slots'),
                    current_user::text,
                    (SELECT rolsuper FROM pg_roles WHERE rolname = current_user),
                    {MAY_REPLICATE},
                    pg_is_in_recovery(),
                    CASE WHEN to_regclass('walbox.relay_state') IS NULL THEN NULL
                         ELSE has_table_privilege('walbox.relay_state', 'INSERT')
                          AND has_table_privilege('walbox.relay_state', 'UPDATE') END"
            ),
            &[],
        )
        .await
        .map_err(slot_manager::Error::sql("read the server's settings"))?;
    Ok(Server {
        version_num: row.get(0),
        wal_level: row.get(1),
        max_slots: row.get(2),
        slots_used: row.get(3),
        max_senders: row.get(4),
        senders_used: row.get(5),
        max_slot_wal_keep_mb: row.get::<_, Option<i64>>(6).unwrap_or(-1),
        idle_slot_timeout_s: row.get(7),
        wal_sender_timeout_ms: row.get::<_, Option<i64>>(8).unwrap_or(60_000),
        synchronized_standby_slots: row.get(9),
        role: row.get(10),
        superuser: row.get::<_, Option<bool>>(11).unwrap_or(false),
        may_replicate: row.get::<_, Option<bool>>(12).unwrap_or(false),
        in_recovery: row.get(13),
        reports_backlog: row.get(14),
    })
}

async fn publication(
    client: &Client,
    name: &str,
) -> Result<Option<Publication>, slot_manager::Error> {
    let Some(row) = client
        .query_opt(
            "SELECT pubinsert, puballtables, pg_has_role(current_user, pubowner, 'USAGE')
               FROM pg_publication WHERE pubname = $1",
            &[&name],
        )
        .await
        .map_err(slot_manager::Error::sql("read the publication"))?
    else {
        return Ok(None);
    };
    let tables = publication_tables(client, name).await?;
    Ok(Some(Publication {
        inserts: row.get(0),
        all_tables: row.get(1),
        owned: row.get(2),
        tables,
    }))
}

async fn table_facts(
    client: &mut Client,
    table: &TableName,
    mapping: &OutboxMapping,
) -> Result<Table, slot_manager::Error> {
    let selectable: bool = client
        .query_one(
            "SELECT has_table_privilege($1, 'SELECT')",
            &[&table.quoted()],
        )
        .await
        .map_err(slot_manager::Error::sql(
            "read the role's rights on the table",
        ))?
        .get(0);
    let unfit = match crate::table_fit::check_fits(client, table, mapping).await {
        Ok(_) => None,
        Err(slot_manager::Error::Precondition(why)) => Some(why),
        Err(e) => Some(e.to_string()),
    };
    let (largest_payload, aggregate_types) = match (selectable, &unfit) {
        (true, None) => measure(client, table, mapping).await,
        (false, _) => (Err("the role may not read the table".into()), Vec::new()),
        (true, Some(_)) => (Err("the table does not fit its mapping".into()), Vec::new()),
    };
    Ok(Table {
        table: table.clone(),
        selectable,
        unfit,
        largest_payload,
        aggregate_types,
    })
}

/// The largest payload and a sample of aggregate types, each under
/// [`MEASURE_TIMEOUT`], in a read-only transaction.
async fn measure(
    client: &mut Client,
    table: &TableName,
    mapping: &OutboxMapping,
) -> (Result<Option<i64>, String>, Vec<String>) {
    let Ok(own) = mapping.for_table(table.schema(), table.name()) else {
        return (Err("no mapping".into()), Vec::new());
    };
    let payload = quote_ident(&own.payload);
    let aggregate = quote_ident(&own.aggregate_type);
    let t = table.quoted();
    let run = async {
        let tx = client.build_transaction().read_only(true).start().await?;
        tx.batch_execute(&format!(
            "SET LOCAL statement_timeout = '{MEASURE_TIMEOUT}'"
        ))
        .await?;
        let largest = tx
            .query_one(
                &format!("SELECT max(octet_length({payload}::text))::int8 FROM {t}"),
                &[],
            )
            .await
            .map(|r| r.get::<_, Option<i64>>(0))
            .map_err(|e| reason(&e));
        // The statement timeout may have aborted the transaction.
        let types = match largest {
            Ok(_) => tx
                .query(
                    &format!(
                        "SELECT DISTINCT a::text FROM (SELECT {aggregate} AS a FROM {t} LIMIT {SAMPLED_ROWS}) s
                          WHERE a IS NOT NULL LIMIT {SAMPLED_TYPES}"
                    ),
                    &[],
                )
                .await
                .map(|rows| rows.iter().map(|r| r.get::<_, String>(0)).collect())
                .unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        let _ = tx.rollback().await;
        Ok::<_, tokio_postgres::Error>((largest, types))
    };
    match run.await {
        Ok((largest, mut types)) => {
            types.sort();
            (largest, types)
        }
        Err(e) => (Err(reason(&e)), Vec::new()),
    }
}

fn reason(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => db.message().to_owned(),
        None => e.to_string(),
    }
}

/// The verdicts.
pub fn judge(f: &Facts, e: &Expected) -> Vec<Finding> {
    let mut out = server_findings(&f.server, e);
    out.extend(slot_findings(f, e));
    if e.tables {
        out.extend(table_findings(f, e));
    }
    out.extend(publication_findings(f, e));
    out
}

fn server_findings(s: &Server, e: &Expected) -> Vec<Finding> {
    let mut out = Vec::new();
    let (least, why) = e.least_server;
    let major = s.version_num / 10_000;
    out.push(match s.version_num >= least {
        true => Finding::pass("postgres.version", format!("Postgres {major}")),
        false => Finding::fail(
            "postgres.version",
            format!("Postgres {major}: {why}"),
            "upgrade the server",
        ),
    });
    if s.in_recovery {
        out.push(Finding::fail(
            "postgres.primary",
            "the server is a standby (pg_is_in_recovery): walbox streams from the primary",
            "point pg_url at the primary (target_session_attrs=read-write with several hosts)",
        ));
    }
    out.push(match s.wal_level.as_str() {
        "logical" => Finding::pass("postgres.wal_level", "logical"),
        other => Finding::fail(
            "postgres.wal_level",
            format!("wal_level is {other}: logical decoding needs logical"),
            "ALTER SYSTEM SET wal_level = logical; then restart Postgres",
        ),
    });
    out.push(headroom(
        "postgres.replication_slots",
        "max_replication_slots",
        s.max_slots,
        s.slots_used,
        "slots exist",
    ));
    out.push(headroom(
        "postgres.wal_senders",
        "max_wal_senders",
        s.max_senders,
        s.senders_used,
        "walsenders run",
    ));
    out.push(match s.max_slot_wal_keep_mb {
        -1 => Finding::warn(
            "postgres.max_slot_wal_keep_size",
            "unlimited: a slot no one streams from keeps WAL until the disk is full and the primary stops",
            "ALTER SYSTEM SET max_slot_wal_keep_size = '<a size below the free WAL disk, e.g. 50GB>'; SELECT pg_reload_conf(); and set on_slot_invalidated (docs/operations.md)",
        ),
        mb => Finding::pass(
            "postgres.max_slot_wal_keep_size",
            format!(
                "{}: past it the slot is invalidated, not the disk filled (on_slot_invalidated decides what walbox does)",
                bytes(mb.saturating_mul(1024 * 1024))
            ),
        ),
    });
    match s.idle_slot_timeout_s {
        None | Some(0) => {}
        Some(secs) if secs < 24 * 3600 => out.push(Finding::warn(
            "postgres.idle_replication_slot_timeout",
            format!(
                "{}: a walbox stopped longer than that (a weekend, a long incident) comes back to an invalidated slot",
                human_secs(secs)
            ),
            "ALTER SYSTEM SET idle_replication_slot_timeout = 0 (or longer than any downtime you expect, e.g. '7d'); SELECT pg_reload_conf()",
        )),
        Some(secs) => out.push(Finding::pass(
            "postgres.idle_replication_slot_timeout",
            format!(
                "{}: a walbox stopped longer than that comes back to an invalidated slot",
                human_secs(secs)
            ),
        )),
    }
    let interval_ms = e.status_interval.as_millis() as i64;
    out.push(match s.wal_sender_timeout_ms {
        0 => Finding::warn(
            "postgres.wal_sender_timeout",
            "0: a dead walbox connection keeps the slot active (and another walbox out) until TCP gives up",
            "ALTER SYSTEM SET wal_sender_timeout = '60s'; SELECT pg_reload_conf()",
        ),
        ms if ms < 2 * interval_ms => Finding::fail(
            "postgres.wal_sender_timeout",
            format!(
                "{ms} ms, under twice walbox's status_interval ({interval_ms} ms): the server drops the connection between two status updates"
            ),
            format!("raise wal_sender_timeout above {} ms, or lower status_interval", 2 * interval_ms),
        ),
        ms => Finding::pass(
            "postgres.wal_sender_timeout",
            format!("{ms} ms, over twice the status interval ({interval_ms} ms)"),
        ),
    });
    out.push(match (s.superuser, s.may_replicate) {
        (true, _) => Finding::pass(
            "postgres.role",
            format!("{} is a superuser (a role with REPLICATION and the table's rights is enough)", s.role),
        ),
        (false, true) => Finding::pass(
            "postgres.role",
            format!("{} may replicate", s.role),
        ),
        (false, false) => Finding::warn(
            "postgres.role",
            format!(
                "{} has neither REPLICATION nor superuser: a self-managed server refuses it a replication connection (managed services grant replication through their own roles)",
                s.role
            ),
            format!(
                "ALTER ROLE {} REPLICATION (RDS: GRANT rds_replication TO {0}; Cloud SQL: ALTER USER … WITH REPLICATION; Azure: ALTER ROLE … WITH REPLICATION)",
                quote_ident(&s.role)
            ),
        ),
    });
    match s.reports_backlog {
        None => out.push(Finding::info(
            "postgres.backlog",
            "walbox.require_capacity() is not installed (walbox migrate installs it): applications cannot see the relay fall behind",
        )),
        Some(true) => out.push(Finding::pass(
            "postgres.backlog",
            "the role may write walbox.relay_state: walbox run reports its backlog for walbox.require_capacity()",
        )),
        Some(false) => out.push(Finding::warn(
            "postgres.backlog",
            format!("{} may not write walbox.relay_state: walbox run cannot report its backlog, and walbox.require_capacity() refuses every write as if no walbox streamed", s.role),
            format!("GRANT INSERT, UPDATE ON walbox.relay_state TO {}", quote_ident(&s.role)),
        )),
    }
    out
}

fn headroom(check: &'static str, setting: &str, max: i64, used: i64, what: &str) -> Finding {
    let saw = format!("{setting} = {max}, {used} {what}");
    match max - used {
        free if free <= 0 => Finding::fail(
            check,
            format!("{saw}: none left for walbox"),
            format!(
                "ALTER SYSTEM SET {setting} = {}; then restart Postgres",
                (max * 2).max(10)
            ),
        ),
        1 => Finding::warn(
            check,
            format!("{saw}: one left, none for a second connector, a standby or a resync"),
            format!(
                "ALTER SYSTEM SET {setting} = {}; then restart Postgres",
                (max * 2).max(10)
            ),
        ),
        _ => Finding::pass(check, saw),
    }
}

fn human_secs(secs: i64) -> String {
    match secs {
        s if s % 86_400 == 0 => format!("{} d", s / 86_400),
        s if s % 3600 == 0 => format!("{} h", s / 3600),
        s if s % 60 == 0 => format!("{} min", s / 60),
        s => format!("{s} s"),
    }
}

fn slot_findings(f: &Facts, e: &Expected) -> Vec<Finding> {
    let mut out = Vec::new();
    // A standby: postgres.primary says so; its slots are not read.
    if f.server.in_recovery {
        return out;
    }
    let Some(slot) = &f.slot else {
        out.push(Finding::info(
            "postgres.slot",
            format!(
                "slot {:?} does not exist yet: walbox init-slot creates it",
                e.slot
            ),
        ));
        return out;
    };
    let name = &e.slot;
    if slot.slot_type != "logical" || slot.plugin.as_deref() != Some("pgoutput") {
        out.push(Finding::fail(
            "postgres.slot",
            format!(
                "slot {name:?} is a {} slot with plugin {}: walbox streams pgoutput",
                slot.slot_type,
                slot.plugin.as_deref().unwrap_or("none")
            ),
            "name another slot (slot = …), or drop this one if nothing else uses it and run walbox init-slot",
        ));
        return out;
    }
    if slot.database.as_deref() != Some(f.database.as_str()) {
        out.push(Finding::fail(
            "postgres.slot",
            format!(
                "slot {name:?} decodes database {}, and pg_url connects to {}",
                slot.database.as_deref().unwrap_or("?"),
                f.database
            ),
            "connect to the slot's database, or name another slot",
        ));
        return out;
    }
    match slot.wal_status.as_deref() {
        Some("lost") => out.push(Finding::fail(
            "postgres.slot",
            format!(
                "slot {name:?} is invalidated ({}): the WAL it needed is gone, and the events in it never streamed",
                slot.invalidation_reason.as_deref().unwrap_or("wal_status lost")
            ),
            "walbox resync --since <before the loss> (or on_slot_invalidated = \"recreate\"), docs/operations.md",
        )),
        Some("unreserved") => out.push(Finding::warn(
            "postgres.slot",
            format!(
                "slot {name:?} keeps {} of WAL, past max_slot_wal_keep_size: it is invalidated at the next checkpoint unless walbox catches up",
                slot.retained_wal_bytes.map_or("?".into(), bytes)
            ),
            "start walbox run now (or raise max_slot_wal_keep_size)",
        )),
        _ => {
            let who = match (slot.active, &slot.application_name) {
                (true, Some(app)) if !app.is_empty() => format!("streamed by {app}"),
                (true, _) => "streamed by a process without application_name".to_owned(),
                (false, _) => "not streamed now".to_owned(),
            };
            out.push(Finding::pass(
                "postgres.slot",
                format!(
                    "slot {name:?}: pgoutput on {}, {who}, {} of WAL kept for it",
                    f.database,
                    slot.retained_wal_bytes.map_or("?".into(), bytes)
                ),
            ));
        }
    }
    if slot.failover == Some(true) {
        out.push(match f.server.synchronized_standby_slots.as_deref() {
            None | Some("") => Finding::warn(
                "postgres.failover",
                format!(
                    "slot {name:?} is a failover slot, and synchronized_standby_slots is empty: walbox may confirm WAL a standby has not received, and after a failover the synchronized slot is behind what the broker holds (or the standby's copy is unusable)"
                ),
                "ALTER SYSTEM SET synchronized_standby_slots = '<the standby's physical slot>'; SELECT pg_reload_conf(); on the standby: sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name set (docs/operations.md, \"Failover slots\")",
            ),
            Some(slots) => Finding::pass(
                "postgres.failover",
                format!(
                    "slot {name:?} is a failover slot; synchronized_standby_slots = {slots} (the standby's own settings are checked with --standby-url)"
                ),
            ),
        });
    }
    out
}

fn table_findings(f: &Facts, e: &Expected) -> Vec<Finding> {
    let mut out = Vec::new();
    if let Some(why) = &f.missing_tables {
        out.push(Finding::fail(
            "postgres.tables",
            why.clone(),
            "create the table, or set table to your outbox",
        ));
    }
    if f.tables.is_empty() && f.missing_tables.is_none() {
        out.push(Finding::warn(
            "postgres.tables",
            format!("no table matches {} yet", e.tables_written),
            "create an outbox table that matches (walbox migrate creates public.outbox_events)",
        ));
    }
    for t in &f.tables {
        let table = &t.table;
        out.push(match t.selectable {
            true => Finding::pass("postgres.select", format!("the role may read {table}")),
            false => Finding::fail(
                "postgres.select",
                format!(
                    "the role may not read {table}: the publication's initial checks, retention, backfills and audits read it"
                ),
                format!("GRANT SELECT ON {} TO <walbox's role>", table.quoted()),
            ),
        });
        out.push(match &t.unfit {
            None => Finding::pass(
                "postgres.table_fit",
                format!("{table} has every column its mapping names"),
            ),
            Some(why) => Finding::fail(
                "postgres.table_fit",
                why.clone(),
                "map the columns in the configuration ([mapping] or [mapping.tables])",
            ),
        });
    }
    out
}

fn publication_findings(f: &Facts, e: &Expected) -> Vec<Finding> {
    let name = &e.publication;
    let Some(p) = &f.publication else {
        return vec![Finding::info(
            "postgres.publication",
            format!("publication {name:?} does not exist yet: walbox init-slot creates it"),
        )];
    };
    let mut out = Vec::new();
    if !p.inserts {
        out.push(Finding::fail(
            "postgres.publication",
            format!("publication {name:?} does not publish INSERTs: no event would stream"),
            format!(
                "ALTER PUBLICATION {} SET (publish = 'insert')",
                quote_ident(name)
            ),
        ));
    }
    if !e.tables {
        if p.inserts {
            out.push(Finding::pass(
                "postgres.publication",
                format!("publication {name:?} exists (source = messages)"),
            ));
        }
        return out;
    }
    let outbox: Vec<&TableName> = f.tables.iter().map(|t| &t.table).collect();
    let missing: Vec<String> = outbox
        .iter()
        .filter(|t| !p.tables.contains(t))
        .map(|t| t.to_string())
        .collect();
    let extra: Vec<String> = p
        .tables
        .iter()
        .filter(|t| !outbox.contains(t))
        .map(|t| t.to_string())
        .collect();
    if !missing.is_empty() {
        out.push(Finding::fail(
            "postgres.publication",
            format!(
                "publication {name:?} does not publish {}: no event of {} would stream",
                missing.join(", "),
                if missing.len() == 1 { "it" } else { "them" }
            ),
            format!(
                "ALTER PUBLICATION {} ADD TABLE {} (in the transaction that creates the table, before its first row; rows already there never stream: re-insert them)",
                quote_ident(name),
                missing.join(", ")
            ),
        ));
    }
    if !extra.is_empty() {
        out.push(Finding::warn(
            "postgres.publication",
            format!(
                "publication {name:?} also publishes {}{}: their changes are decoded and sent to walbox, which drops them",
                if p.all_tables { "every table (FOR ALL TABLES), " } else { "" },
                abbreviate(&extra)
            ),
            format!(
                "publish only the outbox: ALTER PUBLICATION {} SET TABLE {}",
                quote_ident(name),
                outbox.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    if missing.is_empty() && extra.is_empty() && p.inserts {
        out.push(Finding::pass(
            "postgres.publication",
            format!(
                "publication {name:?} publishes INSERTs of exactly the outbox tables ({})",
                outbox.len()
            ),
        ));
    }
    let patterns =
        f.tables.len() > 1 || e.tables_written.contains('*') || e.tables_written.contains(',');
    if patterns && !p.owned {
        out.push(Finding::warn(
            "postgres.publication_owner",
            format!(
                "the role does not own publication {name:?}: walbox cannot add a new matching outbox table to it, and stops when one appears"
            ),
            format!(
                "ALTER PUBLICATION {} OWNER TO <walbox's role> (or add new tables yourself, in the transaction that creates them)",
                quote_ident(name)
            ),
        ));
    }
    out
}

fn abbreviate(names: &[String]) -> String {
    const SHOWN: usize = 5;
    match names.len() {
        n if n > SHOWN => format!("{} and {} more", names[..SHOWN].join(", "), n - SHOWN),
        _ => names.join(", "),
    }
}

/// The standby's side of a failover slot, when `--standby-url` names one.
#[derive(Clone, Debug, Default)]
pub struct Standby {
    /// `pg_is_in_recovery()`.
    pub in_recovery: bool,
    /// `sync_replication_slots`.
    pub sync_replication_slots: Option<String>,
    /// `hot_standby_feedback`.
    pub hot_standby_feedback: String,
    /// `primary_slot_name`.
    pub primary_slot_name: String,
    /// The slot there: `synced`, and not temporary (a synced slot stays
    /// temporary, and is dropped at a promotion, until the primary's slot
    /// has moved past where the standby began).
    pub synced: Option<bool>,
}

/// Reads the standby's facts.
pub async fn gather_standby(client: &Client, slot: &str) -> Result<Standby, slot_manager::Error> {
    let row = client
        .query_one(
            "SELECT pg_is_in_recovery(),
                    (SELECT setting FROM pg_settings WHERE name = 'sync_replication_slots'),
                    current_setting('hot_standby_feedback'),
                    current_setting('primary_slot_name'),
                    (SELECT (to_jsonb(s)->>'synced')::bool AND NOT s.temporary FROM pg_replication_slots s WHERE slot_name = $1)",
            &[&slot],
        )
        .await
        .map_err(slot_manager::Error::sql("read the standby's settings"))?;
    Ok(Standby {
        in_recovery: row.get(0),
        sync_replication_slots: row.get(1),
        hot_standby_feedback: row.get(2),
        primary_slot_name: row.get(3),
        synced: row.get(4),
    })
}

/// The standby's verdicts: the failover slot must be synchronized there.
pub fn judge_standby(s: &Standby, primary: &Server, slot: &str) -> Vec<Finding> {
    let check = "postgres.standby";
    if !s.in_recovery {
        return vec![Finding::fail(
            check,
            "--standby-url connects to a server that is not a standby",
            "point --standby-url at the standby",
        )];
    }
    let mut problems = Vec::new();
    if s.sync_replication_slots.as_deref() != Some("on") {
        problems.push((
            "sync_replication_slots is off (or the server is older than 17)",
            "ALTER SYSTEM SET sync_replication_slots = on",
        ));
    }
    if s.hot_standby_feedback != "on" {
        problems.push((
            "hot_standby_feedback is off: the primary may remove rows the synchronized slot still needs",
            "ALTER SYSTEM SET hot_standby_feedback = on",
        ));
    }
    let listed = primary
        .synchronized_standby_slots
        .as_deref()
        .unwrap_or("")
        .split(',')
        .any(|n| n.trim() == s.primary_slot_name && !n.trim().is_empty());
    if !listed {
        problems.push((
            "its primary_slot_name is not in the primary's synchronized_standby_slots",
            "on the primary: ALTER SYSTEM SET synchronized_standby_slots = '<primary_slot_name of the standby>'",
        ));
    }
    if s.synced != Some(true) {
        problems.push((
            "the slot is not there with synced = true (or only as a temporary slot, until walbox confirms past where the standby began): a promotion now would leave walbox without its slot",
            "create the slot with walbox init-slot --failover, and wait for the standby's slot sync",
        ));
    }
    if problems.is_empty() {
        return vec![Finding::pass(
            check,
            format!("slot {slot:?} is synchronized to the standby (synced = true), with hot_standby_feedback and the primary waiting for it"),
        )];
    }
    let saw: Vec<&str> = problems.iter().map(|(s, _)| *s).collect();
    let fix: Vec<&str> = problems.iter().map(|(_, f)| *f).collect();
    vec![Finding::fail(
        check,
        format!("on the standby: {}", saw.join("; ")),
        format!("{}; then SELECT pg_reload_conf()", fix.join("; ")),
    )]
}

#[cfg(test)]
mod tests {
    use super::super::Verdict;
    use super::*;

    fn healthy() -> (Facts, Expected) {
        let table = TableName::new("public", "outbox_events");
        let facts = Facts {
            server: Server {
                version_num: 170_004,
                wal_level: "logical".into(),
                max_slots: 10,
                slots_used: 1,
                max_senders: 10,
                senders_used: 1,
                max_slot_wal_keep_mb: 10_240,
                idle_slot_timeout_s: None,
                wal_sender_timeout_ms: 60_000,
                synchronized_standby_slots: Some(String::new()),
                role: "walbox".into(),
                superuser: false,
                may_replicate: true,
                in_recovery: false,
                reports_backlog: Some(true),
            },
            database: "app".into(),
            publication: Some(Publication {
                inserts: true,
                all_tables: false,
                owned: true,
                tables: vec![table.clone()],
            }),
            tables: vec![Table {
                table,
                selectable: true,
                unfit: None,
                largest_payload: Ok(Some(300)),
                aggregate_types: vec!["order".into()],
            }],
            missing_tables: None,
            slot: Some(SlotStatus {
                plugin: Some("pgoutput".into()),
                slot_type: "logical".into(),
                database: Some("app".into()),
                wal_status: Some("reserved".into()),
                retained_wal_bytes: Some(1024),
                failover: Some(false),
                ..SlotStatus::default()
            }),
        };
        let expected = Expected {
            slot: "walbox".into(),
            publication: "walbox_outbox".into(),
            least_server: slot_manager::LEAST_SERVER,
            tables: true,
            tables_written: "public.outbox_events".into(),
            status_interval: Duration::from_secs(1),
        };
        (facts, expected)
    }

    fn verdict_of(findings: &[Finding], check: &str) -> Vec<Verdict> {
        findings
            .iter()
            .filter(|f| f.check == check)
            .map(|f| f.verdict)
            .collect()
    }

    #[test]
    fn a_healthy_deployment_passes_everything() {
        let (f, e) = healthy();
        let findings = judge(&f, &e);
        let bad: Vec<_> = findings
            .iter()
            .filter(|f| f.verdict != Verdict::Pass)
            .collect();
        assert!(bad.is_empty(), "{bad:#?}");
    }

    #[test]
    fn each_misconfiguration_has_its_verdict_and_fix() {
        let (mut f, e) = healthy();
        f.server.wal_level = "replica".into();
        f.server.max_slot_wal_keep_mb = -1;
        f.server.max_senders = 2;
        f.server.senders_used = 2;
        f.server.idle_slot_timeout_s = Some(3600);
        f.server.wal_sender_timeout_ms = 1500;
        f.server.may_replicate = false;
        f.server.reports_backlog = Some(false);
        let findings = judge(&f, &e);
        let fix = |check: &str| {
            findings
                .iter()
                .find(|x| x.check == check)
                .and_then(|x| x.fix.clone())
                .unwrap_or_default()
        };
        assert_eq!(verdict_of(&findings, "postgres.wal_level"), [Verdict::Fail]);
        assert!(fix("postgres.wal_level").contains("wal_level = logical"));
        assert_eq!(
            verdict_of(&findings, "postgres.max_slot_wal_keep_size"),
            [Verdict::Warn]
        );
        assert_eq!(
            verdict_of(&findings, "postgres.wal_senders"),
            [Verdict::Fail]
        );
        assert!(fix("postgres.wal_senders").contains("max_wal_senders = 10"));
        assert_eq!(
            verdict_of(&findings, "postgres.idle_replication_slot_timeout"),
            [Verdict::Warn]
        );
        assert_eq!(
            verdict_of(&findings, "postgres.wal_sender_timeout"),
            [Verdict::Fail]
        );
        assert_eq!(verdict_of(&findings, "postgres.role"), [Verdict::Warn]);
        assert_eq!(verdict_of(&findings, "postgres.backlog"), [Verdict::Warn]);
        assert!(fix("postgres.backlog").contains("GRANT INSERT, UPDATE ON walbox.relay_state"));
        assert!(fix("postgres.role").contains("ALTER ROLE \"walbox\" REPLICATION"));
    }

    #[test]
    fn the_publication_must_cover_exactly_the_outbox() {
        let (mut f, e) = healthy();
        let p = f.publication.as_mut().unwrap();
        p.tables = vec![TableName::new("public", "orders")];
        let findings = judge(&f, &e);
        let publication: Vec<_> = findings
            .iter()
            .filter(|x| x.check == "postgres.publication")
            .collect();
        assert_eq!(publication.len(), 2, "{publication:#?}");
        assert_eq!(publication[0].verdict, Verdict::Fail);
        assert!(
            publication[0].fix.as_deref().unwrap().contains(
                "ALTER PUBLICATION \"walbox_outbox\" ADD TABLE \"public\".\"outbox_events\""
            ),
            "{:?}",
            publication[0].fix
        );
        assert_eq!(publication[1].verdict, Verdict::Warn);
        assert!(
            publication[1].saw.contains("\"public\".\"orders\""),
            "{}",
            publication[1].saw
        );
    }

    #[test]
    fn a_lost_or_foreign_slot_fails_and_a_missing_one_is_said() {
        let (mut f, e) = healthy();
        f.slot.as_mut().unwrap().wal_status = Some("lost".into());
        assert_eq!(verdict_of(&judge(&f, &e), "postgres.slot"), [Verdict::Fail]);
        f.slot.as_mut().unwrap().plugin = Some("wal2json".into());
        assert_eq!(verdict_of(&judge(&f, &e), "postgres.slot"), [Verdict::Fail]);
        f.slot = None;
        assert_eq!(verdict_of(&judge(&f, &e), "postgres.slot"), [Verdict::Info]);
    }

    #[test]
    fn a_failover_slot_needs_the_standby_named() {
        let (mut f, e) = healthy();
        f.slot.as_mut().unwrap().failover = Some(true);
        assert_eq!(
            verdict_of(&judge(&f, &e), "postgres.failover"),
            [Verdict::Warn]
        );
        f.server.synchronized_standby_slots = Some("standby1".into());
        assert_eq!(
            verdict_of(&judge(&f, &e), "postgres.failover"),
            [Verdict::Pass]
        );
        let mut standby = Standby {
            in_recovery: true,
            sync_replication_slots: Some("on".into()),
            hot_standby_feedback: "on".into(),
            primary_slot_name: "standby1".into(),
            synced: Some(true),
        };
        let v = |s: &Standby| judge_standby(s, &f.server, "walbox")[0].verdict;
        assert_eq!(v(&standby), Verdict::Pass);
        standby.hot_standby_feedback = "off".into();
        assert_eq!(v(&standby), Verdict::Fail);
        standby.hot_standby_feedback = "on".into();
        standby.synced = Some(false);
        assert_eq!(v(&standby), Verdict::Fail);
        standby.synced = Some(true);
        standby.primary_slot_name = "other".into();
        assert_eq!(v(&standby), Verdict::Fail);
    }
}
