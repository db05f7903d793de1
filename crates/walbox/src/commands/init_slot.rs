//! `walbox init-slot`: the publication and the slot, idempotently; with
//! `--backfill`, the slot is made with a snapshot whose matching rows are
//! published first ([`crate::backfill`]).

use slot_manager::{
    check_server, connect_control, ensure_message_publication, ensure_publication, ensure_slot,
    ensure_tables_publication, Ensured,
};

use super::{loaded, CliError};
use crate::backfill::{backfill, Outcome, Plan, Request};
use crate::config::{ConfigError, RunFlags};
use crate::table_fit::check_fits;

/// Arguments of `walbox init-slot`.
#[derive(Debug, clap::Args)]
pub struct InitSlotArgs {
    #[command(flatten)]
    settings: RunFlags,
    /// Create a failover slot, synchronized to standbys (Postgres 17+).
    #[arg(long)]
    failover: bool,
    /// Publish the outbox rows matching this SQL condition as they are in
    /// the new slot's snapshot, before `walbox run` streams what commits
    /// after it (e.g. "published_at IS NULL" when switching over from a
    /// polling relay). Needs the Kafka settings of `run`. Rerun the same
    /// command to finish an interrupted backfill.
    #[arg(long, value_name = "SQL_CONDITION")]
    backfill: Option<String>,
    /// The order backfilled rows are published in, as SQL (e.g.
    /// "created_at, id" or "seq"); the event id breaks ties. Default: the
    /// stream's order as far as the table tells it: commit timestamps
    /// (with track_commit_timestamp = on), else a sequence column (an
    /// identity or nextval default, as walbox migrate's seq), else the
    /// timestamp column, else the event id.
    #[arg(long, value_name = "SQL_ORDER", requires = "backfill")]
    backfill_order: Option<String>,
}

fn say(what: &str, name: &str, e: Ensured) {
    match e {
        Ensured::Created => println!("{what} {name:?}: created"),
        Ensured::AlreadyPresent => println!("{what} {name:?}: already present"),
    }
}

/// A new slot of several outbox tables: the tables published now are what
/// `walbox run` knows published (any joining later is examined, see
/// [`crate::bookkeeping::joined`]); a record of an earlier slot of the name
/// is forgotten. Best effort: without it, the first `walbox run` takes the
/// tables published then.
async fn record_published(
    client: &tokio_postgres::Client,
    slot: &str,
    publication: &str,
    tables: &[slot_manager::TableName],
) {
    let recorded = async {
        crate::bookkeeping::joined::forget(client, slot).await?;
        let entries = slot_manager::joined(client, publication, tables).await?;
        crate::bookkeeping::joined::record(client, slot, &entries).await
    };
    if let Err(e) = recorded.await {
        tracing::warn!(error = %e, slot, "the published outbox tables were not recorded in walbox.published_tables; walbox run records them as it starts");
    }
}

/// A new slot streams what commits after it, not the rows already in the
/// table. Usually they were published by whatever ran before (or are
/// meant to be skipped); if not — a Debezium connector with
/// `slot.drop.on.stop=true` dropped its slot as it stopped, a slot was lost —
/// they never will be. Said, with the fix, as a warning; one cheap look per
/// table (`EXISTS`), never a count.
async fn warn_rows_before(client: &tokio_postgres::Client, tables: &[slot_manager::TableName]) {
    for table in tables {
        let sql = format!("SELECT EXISTS (SELECT 1 FROM {})", table.quoted());
        if let Ok(row) = client.query_one(&sql, &[]).await {
            if row.get::<_, bool>(0) {
                tracing::warn!(%table, "the table already holds rows; the new slot streams only what commits from now on. If some were never published (a Debezium connector with slot.drop.on.stop=true, a dropped or lost slot), publish them: walbox drop-slot, then walbox init-slot --backfill \"<condition>\" (docs/migrating-from-a-polling-relay.md)");
            }
        }
    }
}

/// Checks the server and table, then ensures the publication and the slot
/// (and backfills, when asked).
pub async fn run(args: InitSlotArgs) -> Result<(), CliError> {
    let config = loaded(args.settings.load())?;
    let c = config.connection()?;
    let mapping = config.mapping()?;
    if !c.source.table() && args.backfill.is_some() {
        return Err(ConfigError(
            "--backfill publishes rows of the outbox table; with source = messages there is none (use source = both to stream messages and backfill the table)".into(),
        )
        .into());
    }
    if c.shards > 1 && args.backfill.is_some() {
        return Err(ConfigError(
            "--backfill with shards > 1 is not supported: backfill unsharded, or publish the rows before sharding".into(),
        )
        .into());
    }
    if args.backfill.is_some() {
        // Before the slot is made: nothing to undo.
        config.run()?;
    }
    let mut client = connect_control(&c.pg).await?;
    let (least, why) = c.least_server();
    check_server(&client, least, why).await?;
    // Every table found now fits its mapping; one a pattern finds
    // later is checked as walbox run picks it up.
    let tables = if c.source.table() {
        c.tables.resolve(&client).await?
    } else {
        Vec::new()
    };
    for table in &tables {
        check_fits(&client, table, &mapping).await?;
    }
    let Some(condition) = args.backfill else {
        // Every shard's publication and slot (one of each when not sharded).
        let mut created = false;
        for s in c.selected_shards() {
            let publication = match (s.source.table(), s.tables.single()) {
                (false, _) => ensure_message_publication(&client, &s.publication).await?,
                (true, Some(table)) => {
                    ensure_publication(&client, &s.publication, table, s.shard.as_ref()).await?
                }
                (true, None) => {
                    ensure_tables_publication(&client, &s.publication, &s.tables, &tables).await?
                }
            };
            say("publication", &s.publication, publication);
            let slot = ensure_slot(&client, &s.slot, args.failover).await?;
            say("slot", &s.slot, slot);
            created |= slot == Ensured::Created;
            if slot == Ensured::Created && s.source.table() && s.tables.single().is_none() {
                record_published(&client, &s.slot, &s.publication, &tables).await;
            }
        }
        // Said once, however many shards' slots were made (no tables with
        // source = messages).
        if created {
            warn_rows_before(&client, &tables).await;
        }
        return Ok(());
    };
    let table = c.table("init-slot --backfill")?;
    let publication = if c.source.table() {
        ensure_publication(&client, &c.publication, table, None).await?
    } else {
        ensure_message_publication(&client, &c.publication).await?
    };
    say("publication", &c.publication, publication);
    let settings = config.run()?;
    let order_by = match args.backfill_order {
        Some(order) => order,
        None => {
            let order = crate::backfill::order::choose(&client, table, &mapping).await?;
            order.report(table);
            order.sql
        }
    };
    let plan = Plan {
        pg: &c.pg,
        slot: &c.slot,
        failover: args.failover,
        table,
        mapping: &mapping,
        settings: &settings,
    };
    let request = Request {
        condition,
        order_by,
    };
    match backfill(plan, &mut client, &request).await? {
        Outcome::AlreadyDone { total } => {
            println!(
                "slot {:?}: already present, its backfill done ({total} events)",
                c.slot
            );
        }
        Outcome::Published {
            total,
            published,
            dead_lettered,
            resumed,
        } => {
            let how = if resumed {
                "resumed and finished"
            } else {
                "created"
            };
            println!(
                "slot {:?}: {how}; backfill published {published} of {total} events ({dead_lettered} to the dead-letter topic); `walbox run` streams from here",
                c.slot
            );
        }
    }
    Ok(())
}
