//! Publication and slot lifecycle, over an ordinary SQL connection.
//!
//! Every check that fails says what to change in one line.

use std::time::Duration;

use pgoutput_decoder::Lsn;
use tokio_postgres::Client;

use crate::config::PgConfig;
use crate::error::Error;
use crate::shard::ShardFilter;
use crate::sql::{quote_ident, TableName};
use crate::tls;

/// Opens an ordinary SQL connection with the same settings (TLS included) and
/// spawns its connection task.
pub async fn connect_control(config: &PgConfig) -> Result<Client, Error> {
    match tls::client_config(config)? {
        Some(tls_config) => {
            let connector = tokio_postgres_rustls::MakeRustlsConnect::new((*tls_config).clone());
            connect_with(config, connector).await
        }
        None => connect_with(config, tokio_postgres::NoTls).await,
    }
}

async fn connect_with<T>(config: &PgConfig, tls: T) -> Result<Client, Error>
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>,
    T::Stream: Send + 'static,
{
    let (client, connection) = config
        .tokio_config()
        .connect(tls)
        .await
        .map_err(Error::sql(format!("connect to {}", config.describe())))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "control connection ended");
        }
    });
    Ok(client)
}

/// Checks that the server and role can run walbox on `table` and that the
/// table has `required_columns`. Each failure is an [`Error::Precondition`]
/// that says what to change.
///
/// The role's right to replicate is not checked here: managed services
/// grant it their own way (AWS RDS and Aurora through membership in
/// `rds_replication`, with `rolreplication` false), so the server decides
/// when walbox starts replicating, and its refusal becomes
/// [`Error::ReplicationRefused`], which says how to grant it.
pub async fn preflight(
    client: &Client,
    table: &TableName,
    required_columns: &[&str],
) -> Result<(), Error> {
    let (least, why) = LEAST_SERVER;
    check_server(client, least, why).await?;
    check_table(client, table, required_columns).await
}

/// SQL, true when `current_user` may replicate as far as the catalog tells:
/// the REPLICATION attribute, superuser, or a managed service's replication
/// role (RDS's `rds_replication`). Elsewhere the server alone decides.
pub const MAY_REPLICATE: &str =
    "(SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user)
     OR CASE WHEN EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rds_replication')
             THEN pg_has_role(current_user, 'rds_replication', 'member') ELSE false END";

/// The oldest server walbox runs on (`server_version_num`), and what to say
/// to an older one.
pub const LEAST_SERVER: (i32, &str) = (130_000, "walbox needs 13 or later");

/// Checks the server settings [`preflight`] checks, with `least_version`
/// (`server_version_num`) and what to say when the server is older: 13 for
/// everything, 14 for logical decoding messages as events.
pub async fn check_server(client: &Client, least_version: i32, why: &str) -> Result<(), Error> {
    let row = client
        .query_one(
            &format!(
                "SELECT current_setting('wal_level'), current_setting('server_version_num')::int, current_user::text,
                        {MAY_REPLICATE},
                        current_setting('max_replication_slots')::int"
            ),
            &[],
        )
        .await
        .map_err(Error::sql("read server settings"))?;
    let wal_level: String = row.get(0);
    let server_version_num: i32 = row.get(1);
    let user: String = row.get(2);
    let may_replicate: bool = row.get(3);
    let max_slots: i32 = row.get(4);
    if wal_level != "logical" {
        return Err(Error::Precondition(format!(
            "wal_level is {wal_level}; walbox needs wal_level = logical \
             (ALTER SYSTEM SET wal_level = logical; then restart Postgres)"
        )));
    }
    if server_version_num < least_version {
        return Err(Error::Precondition(format!(
            "Postgres {} is too old; {why}",
            server_version_num / 10_000
        )));
    }
    if !may_replicate {
        tracing::info!(
            role = %user,
            "the role has neither REPLICATION nor superuser; the server decides whether it may replicate (managed services grant it through their own roles)"
        );
    }
    if max_slots == 0 {
        return Err(Error::Precondition(
            "max_replication_slots is 0; set it to at least 1 and restart Postgres".into(),
        ));
    }
    Ok(())
}

/// Checks that `table` exists and has `required_columns` (the second half
/// of [`preflight`]).
pub async fn check_table(
    client: &Client,
    table: &TableName,
    required_columns: &[&str],
) -> Result<(), Error> {
    let columns: Option<Vec<String>> = client
        .query_opt(
            "SELECT array_agg(a.attname::text ORDER BY a.attnum)
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
               LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
              WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')
              GROUP BY c.oid",
            &[&table.schema(), &table.name()],
        )
        .await
        .map_err(Error::sql("look up the outbox table"))?
        .map(|r| r.get(0));
    let Some(columns) = columns else {
        return Err(Error::Precondition(format!(
            "table {table} does not exist: create it (`walbox migrate` creates public.outbox_events) or point --table at your outbox"
        )));
    };
    let missing: Vec<&str> = required_columns
        .iter()
        .copied()
        .filter(|c| !columns.iter().any(|have| have == c))
        .collect();
    if !missing.is_empty() {
        return Err(Error::Precondition(format!(
            "table {table} has no column {} (it has {}); map the outbox columns in the configuration",
            missing.join(", "),
            columns.join(", ")
        )));
    }
    Ok(())
}

/// The base type of each domain type among `table`'s columns (nested domains
/// resolved to the last base), by type OID: the Relation messages of
/// pgoutput carry a column's declared type, which may be a domain.
pub async fn domain_base_types(
    client: &Client,
    table: &TableName,
) -> Result<std::collections::HashMap<u32, u32>, Error> {
    let rows = client
        .query(
            "WITH RECURSIVE d(domain, base) AS (
                 SELECT t.oid, t.typbasetype FROM pg_attribute a
                   JOIN pg_class c ON c.oid = a.attrelid
                   JOIN pg_namespace n ON n.oid = c.relnamespace
                   JOIN pg_type t ON t.oid = a.atttypid
                  WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0
                    AND NOT a.attisdropped AND t.typtype = 'd'
                 UNION
                 SELECT d.domain, t.typbasetype FROM d JOIN pg_type t ON t.oid = d.base
                  WHERE t.typtype = 'd')
             SELECT d.domain::int8, d.base::int8 FROM d JOIN pg_type t ON t.oid = d.base
              WHERE t.typtype <> 'd'",
            &[&table.schema(), &table.name()],
        )
        .await
        .map_err(Error::sql("look up the outbox table's domain types"))?;
    Ok(rows
        .iter()
        .map(|r| (r.get::<_, i64>(0) as u32, r.get::<_, i64>(1) as u32))
        .collect())
}

/// Whether an `ensure_*` call created the object or found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ensured {
    /// Created now.
    Created,
    /// Already there, and fit for use.
    AlreadyPresent,
}

/// Makes sure `publication` publishes inserts of `table`:
/// `CREATE PUBLICATION … FOR TABLE … WITH (publish = 'insert', publish_via_partition_root = true)`.
/// An existing publication that does not cover the table or does not publish
/// inserts is an error, not silently reused.
pub async fn ensure_publication(
    client: &Client,
    publication: &str,
    table: &TableName,
    shard: Option<&ShardFilter>,
) -> Result<Ensured, Error> {
    let existing = client
        .query_opt(
            "SELECT p.pubinsert,
                    EXISTS (SELECT 1 FROM pg_publication_tables t
                             WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3)
               FROM pg_publication p WHERE p.pubname = $1",
            &[&publication, &table.schema(), &table.name()],
        )
        .await
        .map_err(Error::sql("look up the publication"))?;
    let filter = shard
        .map(|s| format!(" WHERE ({})", s.sql()))
        .unwrap_or_default();
    if let Some(row) = existing {
        let (inserts, covers): (bool, bool) = (row.get(0), row.get(1));
        if !covers {
            return Err(Error::Precondition(format!(
                "publication {publication:?} exists but does not publish {table} \
                 (ALTER PUBLICATION {} ADD TABLE {table}{filter}, or choose another --publication)",
                quote_ident(publication)
            )));
        }
        if !inserts {
            return Err(Error::Precondition(format!(
                "publication {publication:?} exists but does not publish inserts \
                 (ALTER PUBLICATION {} SET (publish = 'insert'), or choose another --publication)",
                quote_ident(publication)
            )));
        }
        if shard.is_some() {
            // A shard's publication must hold its own filter: the same
            // check `walbox run` makes.
            if let Some(gap) = crate::coverage(client, publication, table, shard)
                .await?
                .gap
            {
                return Err(Error::Precondition(gap));
            }
        }
        return Ok(Ensured::AlreadyPresent);
    }
    let create = format!(
        "CREATE PUBLICATION {} FOR TABLE {}{filter} {PUBLICATION_OPTIONS}",
        quote_ident(publication),
        table.quoted()
    );
    match client.batch_execute(&create).await {
        Ok(()) => Ok(Ensured::Created),
        // Creating a publication takes CREATE on the database and owning
        // the table: say which grant, and the other way (a DBA makes it).
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => {
            let who: (String, String) = client
                .query_one("SELECT current_user::text, current_database()::text", &[])
                .await
                .map(|r| (r.get(0), r.get(1)))
                .map_err(Error::sql("look up the role"))?;
            let server = e
                .as_db_error()
                .map_or_else(|| e.to_string(), |d| d.message().to_owned());
            Err(Error::Precondition(format!(
                "creating publication {publication:?} was refused: the server says \"{server}\". \
                 It takes CREATE on the database and ownership of {table}: GRANT CREATE ON DATABASE {} TO {}, \
                 or have the table's owner or a DBA run {create}; walbox init-slot then finds it and creates the slot \
                 (docs/operations.md, \"Least privilege\")",
                quote_ident(&who.1),
                quote_ident(&who.0),
            )))
        }
        Err(e) => Err(Error::sql(format!("create publication {publication:?}"))(e)),
    }
}

/// What walbox's publications publish: INSERTs only, a partitioned table's
/// under its own name.
const PUBLICATION_OPTIONS: &str = "WITH (publish = 'insert', publish_via_partition_root = true)";

/// [`ensure_publication`] for several outbox tables: `tables` are those
/// found now (see [`crate::OutboxTables::resolve`]). A new publication
/// covers them all (none: it is made empty, for tables still to come); an
/// existing one must publish inserts and cover every table named without a
/// pattern. Tables a pattern finds later are `walbox run`'s to pick up.
pub async fn ensure_tables_publication(
    client: &Client,
    publication: &str,
    outbox: &crate::OutboxTables,
    tables: &[TableName],
) -> Result<Ensured, Error> {
    let existing = client
        .query_opt(
            "SELECT pubinsert FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .map_err(Error::sql("look up the publication"))?;
    if let Some(row) = existing {
        if !row.get::<_, bool>(0) {
            return Err(Error::Precondition(format!(
                "publication {publication:?} exists but does not publish inserts \
                 (ALTER PUBLICATION {} SET (publish = 'insert'), or choose another --publication)",
                quote_ident(publication)
            )));
        }
        let published = outbox.published(client, publication).await?;
        if let Some(table) = outbox.named().find(|e| !published.contains(e)) {
            return Err(Error::Precondition(format!(
                "publication {publication:?} exists but does not publish {table} \
                 (ALTER PUBLICATION {} ADD TABLE {table}, or choose another --publication)",
                quote_ident(publication)
            )));
        }
        return Ok(Ensured::AlreadyPresent);
    }
    let list: Vec<String> = tables.iter().map(TableName::quoted).collect();
    let tables = match list.is_empty() {
        true => String::new(),
        false => format!(" FOR TABLE {}", list.join(", ")),
    };
    let create = format!(
        "CREATE PUBLICATION {}{tables} {PUBLICATION_OPTIONS}",
        quote_ident(publication)
    );
    client
        .batch_execute(&create)
        .await
        .map_err(Error::sql(format!("create publication {publication:?}")))?;
    Ok(Ensured::Created)
}

async fn publication_exists(client: &Client, publication: &str) -> Result<bool, Error> {
    Ok(client
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .map_err(Error::sql("look up the publication"))?
        .is_some())
}

/// Makes sure `publication` exists, for a slot that streams logical decoding
/// messages only (they belong to no table). A missing one is created empty;
/// an existing one is used as it is (its tables' changes are not events in
/// that mode).
pub async fn ensure_message_publication(
    client: &Client,
    publication: &str,
) -> Result<Ensured, Error> {
    if publication_exists(client, publication).await? {
        return Ok(Ensured::AlreadyPresent);
    }
    client
        .batch_execute(&format!("CREATE PUBLICATION {}", quote_ident(publication)))
        .await
        .map_err(Error::sql(format!("create publication {publication:?}")))?;
    Ok(Ensured::Created)
}

/// Makes sure the pgoutput slot `slot` exists in this database. `failover`
/// (Postgres 17+) makes it a failover slot, synchronized to standbys.
pub async fn ensure_slot(client: &Client, slot: &str, failover: bool) -> Result<Ensured, Error> {
    let existing = client
        .query_opt(
            "SELECT plugin::text, database::text = current_database(), slot_type::text
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(Error::sql("look up the replication slot"))?;
    if let Some(row) = existing {
        let (plugin, same_db, kind): (Option<String>, Option<bool>, String) =
            (row.get(0), row.get(1), row.get(2));
        if kind != "logical" || plugin.as_deref() != Some("pgoutput") {
            return Err(Error::Precondition(format!(
                "replication slot {slot:?} exists but is a {kind} slot with plugin {}; walbox needs a pgoutput logical slot \
                 (drop it or choose another --slot)",
                plugin.as_deref().unwrap_or("none")
            )));
        }
        if same_db != Some(true) {
            return Err(Error::Precondition(format!(
                "replication slot {slot:?} exists but belongs to another database; choose another --slot"
            )));
        }
        return Ok(Ensured::AlreadyPresent);
    }
    if failover {
        let version: i32 = client
            .query_one("SELECT current_setting('server_version_num')::int", &[])
            .await
            .map_err(Error::sql("read the server version"))?
            .get(0);
        if version < 170_000 {
            return Err(Error::Precondition(format!(
                "failover slots need Postgres 17 or later; this server is {}",
                version / 10_000
            )));
        }
    }
    let sql = if failover {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
    };
    if let Err(e) = client.query_one(sql, &[&slot]).await {
        let user = current_user(client).await;
        return Err(Error::sql(format!("create replication slot {slot:?}"))(e)
            .explain_replication_refusal(&user));
    }
    Ok(Ensured::Created)
}

/// The role of `client`'s session, for error messages.
async fn current_user(client: &Client) -> String {
    match client.query_one("SELECT current_user::text", &[]).await {
        Ok(row) => row.get(0),
        Err(_) => "(walbox's role)".to_owned(),
    }
}

/// What [`drop_slot`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dropped {
    /// The slot existed and was dropped.
    pub slot: bool,
    /// The process holding the slot was terminated first (`force`).
    pub terminated_pid: Option<i32>,
    /// The publication existed and was dropped.
    pub publication: bool,
}

/// Drops `slot`. While a process streams from it, refuses with
/// [`Error::SlotActive`] unless `force`, which terminates that process first.
/// With `publication`, drops that publication too.
pub async fn drop_slot(
    client: &Client,
    slot: &str,
    force: bool,
    publication: Option<&str>,
) -> Result<Dropped, Error> {
    let mut dropped = Dropped {
        slot: false,
        terminated_pid: None,
        publication: false,
    };
    let state = client
        .query_opt(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(Error::sql("look up the replication slot"))?;
    if let Some(row) = state {
        if let Some(pid) = row.get::<_, Option<i32>>(0) {
            if !force {
                return Err(Error::SlotActive {
                    slot: slot.to_owned(),
                    pid,
                });
            }
            client
                .execute("SELECT pg_terminate_backend($1)", &[&pid])
                .await
                .map_err(Error::sql("terminate the slot's process"))?;
            dropped.terminated_pid = Some(pid);
            // The slot is released when the walsender has exited.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                let active: Option<bool> = client
                    .query_opt(
                        "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                        &[&slot],
                    )
                    .await
                    .map_err(Error::sql("look up the replication slot"))?
                    .map(|r| r.get(0));
                if active != Some(true) {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(Error::SlotActive {
                        slot: slot.to_owned(),
                        pid,
                    });
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        if let Err(e) = client
            .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
            .await
        {
            let user = current_user(client).await;
            return Err(crate::error::classify_slot_error(
                slot,
                Error::from_db(e, "drop the slot").explain_replication_refusal(&user),
            ));
        }
        dropped.slot = true;
    }
    if let Some(publication) = publication {
        if publication_exists(client, publication).await? {
            client
                .batch_execute(&format!("DROP PUBLICATION {}", quote_ident(publication)))
                .await
                .map_err(Error::sql(format!("drop publication {publication:?}")))?;
            dropped.publication = true;
        }
    }
    Ok(dropped)
}

/// A slot's state, for `walbox status`, `walbox doctor` and the relay's
/// checks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SlotStatus {
    /// `logical` or `physical`.
    pub slot_type: String,
    /// Its output plugin (`pgoutput` for walbox's); `None` for a physical
    /// slot.
    pub plugin: Option<String>,
    /// The database it decodes; `None` for a physical slot.
    pub database: Option<String>,
    /// A failover slot, synchronized to standbys (Postgres 17+; `None`
    /// before).
    pub failover: Option<bool>,
    /// A process is streaming from it.
    pub active: bool,
    /// That process.
    pub active_pid: Option<i32>,
    /// Where streaming resumes; what walbox confirmed.
    pub confirmed_flush_lsn: Option<Lsn>,
    /// The oldest WAL the slot keeps.
    pub restart_lsn: Option<Lsn>,
    /// `pg_current_wal_lsn() - restart_lsn`: WAL kept on disk for this slot.
    pub retained_wal_bytes: Option<i64>,
    /// `reserved`, `extended`, `unreserved` or `lost` (lost: unusable).
    pub wal_status: Option<String>,
    /// Bytes of WAL that can still be written before the slot is in danger
    /// of losing WAL (`max_slot_wal_keep_size`); `None` when unlimited.
    pub safe_wal_size: Option<i64>,
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`: WAL written since the
    /// position confirmed (the slot's lag).
    pub confirmed_lag_bytes: Option<i64>,
    /// Why the slot was invalidated (`wal_removed`, `rows_removed`,
    /// `wal_level_insufficient`, `idle_timeout`; Postgres 17+), if it was.
    pub invalidation_reason: Option<String>,
    /// The streaming process's `application_name` (`walbox` unless
    /// `PGAPPNAME` or the connection string says otherwise; the Helm chart
    /// sets the pod's name).
    pub application_name: Option<String>,
    /// Where the streaming process connects from
    /// (`pg_stat_replication.client_addr`; `None` over a Unix socket).
    pub client_addr: Option<String>,
    /// Seconds between WAL being flushed locally and the streaming process
    /// confirming it (`pg_stat_replication.flush_lag`); `None` when idle
    /// or not streaming.
    pub confirmed_lag_seconds: Option<f64>,
}

/// What an inactive slot still holds past its confirmed position: the
/// events (published INSERTs, and logical decoding messages when
/// `messages`) it would stream, counted by decoding its pending WAL with
/// `pg_logical_slot_peek_binary_changes` (which consumes nothing, but
/// decodes all of it: seconds per GB of WAL), and the WAL bytes written
/// since the confirmed position (other tables' writes included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pending {
    /// Events not yet confirmed.
    pub events: i64,
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`.
    pub wal_bytes: i64,
}

/// See [`Pending`]. Fails when the slot is in use, invalidated, or its
/// publication is gone: then what it holds cannot be told.
pub async fn pending_events(
    client: &Client,
    slot: &str,
    publication: &str,
    messages: bool,
) -> Result<Pending, Error> {
    // 'I' (73) is an INSERT, 'M' (77) a logical decoding message.
    let sql = if messages {
        "SELECT count(*) FILTER (WHERE get_byte(data, 0) IN (73, 77)),
                (SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint
                   FROM pg_replication_slots WHERE slot_name = $1)
           FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                'proto_version', '1', 'publication_names', $2, 'messages', 'true')"
    } else {
        "SELECT count(*) FILTER (WHERE get_byte(data, 0) = 73),
                (SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint
                   FROM pg_replication_slots WHERE slot_name = $1)
           FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                'proto_version', '1', 'publication_names', $2)"
    };
    let row = client
        .query_one(sql, &[&slot, &crate::sql::quote_ident(publication)])
        .await
        .map_err(Error::sql("read what the slot still holds"))?;
    Ok(Pending {
        events: row.get(0),
        wal_bytes: row.get::<_, Option<i64>>(1).unwrap_or(0),
    })
}

/// The slot's state, or `None` when it does not exist.
pub async fn slot_status(client: &Client, slot: &str) -> Result<Option<SlotStatus>, Error> {
    let row = client
        .query_opt(
            "SELECT active, active_pid, confirmed_flush_lsn::text, restart_lsn::text,
                    (pg_current_wal_lsn() - restart_lsn)::bigint, wal_status::text, safe_wal_size::bigint,
                    (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint,
                    -- Postgres 17 has invalidation_reason; earlier ones only wal_status.
                    (to_jsonb(s) ->> 'invalidation_reason'),
                    r.application_name::text,
                    extract(epoch FROM r.flush_lag)::float8,
                    host(r.client_addr),
                    s.slot_type, s.plugin::text, s.database::text,
                    (to_jsonb(s) ->> 'failover')::bool
               FROM pg_replication_slots s
               LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
              WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(Error::sql("read the replication slot"))?;
    let lsn = |v: Option<String>| v.and_then(|s| s.parse().ok());
    Ok(row.map(|r| SlotStatus {
        active: r.get(0),
        active_pid: r.get(1),
        confirmed_flush_lsn: lsn(r.get(2)),
        restart_lsn: lsn(r.get(3)),
        retained_wal_bytes: r.get(4),
        wal_status: r.get(5),
        safe_wal_size: r.get(6),
        confirmed_lag_bytes: r.get(7),
        invalidation_reason: r.get(8),
        application_name: r.get(9),
        confirmed_lag_seconds: r.get(10),
        client_addr: r.get(11),
        slot_type: r.get(12),
        plugin: r.get(13),
        database: r.get(14),
        failover: r.get(15),
    }))
}
