//! The outbox tables walbox knew published, per slot
//! (`walbox.published_tables`), with several outbox tables: each entry is a
//! table's joining of the publication (its OID and the transaction that
//! added it, [`slot_manager::Joined`]).
//!
//! A table that joins the publication by someone else's `ALTER
//! PUBLICATION` while walbox is stopped leaves no trace in the stream: the
//! next session's first reading finds it published like any other. This
//! record tells it apart: an entry not recorded joined since walbox last
//! looked, and is accepted only if it holds no row from before its
//! joining ([`slot_manager::rows_before_joining`]).
//!
//! The first session of a slot without a record takes the tables published
//! then as they are (its baseline, marked by a row of OID 0): a table added
//! by hand before that is not examined. `init-slot` records the baseline as
//! it creates the slot, `drop-slot` forgets it. A record that cannot be
//! written (no right to create walbox's schema or table) is said once and
//! leaves the start unchecked, never stops walbox.

use slot_manager::{Error, Joined};
use tokio_postgres::Client;

use crate::bookkeeping;

/// The table, created on first use (see [`crate::bookkeeping`]).
const TABLE: &str = "
CREATE TABLE IF NOT EXISTS walbox.published_tables (
    slot text NOT NULL,
    table_oid oid NOT NULL,
    joined_xid text NOT NULL,
    table_name text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (slot, table_oid, joined_xid)
);
GRANT SELECT ON walbox.published_tables TO PUBLIC;";

/// The OID of the row that marks a slot's baseline.
const BASELINE: u32 = 0;

/// The joinings recorded for `slot`, as (OID, transaction); `None` when
/// none was ever recorded (no baseline yet).
pub async fn load(client: &Client, slot: &str) -> Result<Option<Vec<(u32, String)>>, Error> {
    if !bookkeeping::exist(client, &["walbox.published_tables"]).await? {
        return Ok(None);
    }
    let rows = client
        .query(
            "SELECT table_oid, joined_xid FROM walbox.published_tables WHERE slot = $1",
            &[&slot],
        )
        .await
        .map_err(Error::sql("read walbox.published_tables"))?;
    let entries: Vec<(u32, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    if !entries.iter().any(|(oid, _)| *oid == BASELINE) {
        return Ok(None);
    }
    Ok(Some(
        entries
            .into_iter()
            .filter(|(oid, _)| *oid != BASELINE)
            .collect(),
    ))
}

/// Records `entries` as known published for `slot` (and the baseline
/// mark); creates the table on first use.
pub async fn record(client: &Client, slot: &str, entries: &[Joined]) -> Result<(), Error> {
    if !bookkeeping::exist(client, &["walbox.published_tables"]).await? {
        bookkeeping::create(client, TABLE, "create walbox.published_tables").await?;
    }
    let mut oids: Vec<u32> = vec![BASELINE];
    let mut xids: Vec<String> = vec![String::new()];
    let mut names: Vec<String> = vec!["(baseline)".to_owned()];
    for e in entries {
        oids.push(e.oid);
        xids.push(e.xid.clone());
        names.push(e.table.to_string());
    }
    client
        .execute(
            "INSERT INTO walbox.published_tables (slot, table_oid, joined_xid, table_name)
             SELECT $1, o, x, n FROM unnest($2::oid[], $3::text[], $4::text[]) t(o, x, n)
             ON CONFLICT DO NOTHING",
            &[&slot, &oids, &xids, &names],
        )
        .await
        .map_err(Error::sql(
            "record the published outbox tables in walbox.published_tables",
        ))?;
    Ok(())
}

/// Forgets `slot`'s record (its slot dropped, or made anew).
pub async fn forget(client: &Client, slot: &str) -> Result<(), Error> {
    if !bookkeeping::exist(client, &["walbox.published_tables"]).await? {
        return Ok(());
    }
    client
        .execute(
            "DELETE FROM walbox.published_tables WHERE slot = $1",
            &[&slot],
        )
        .await
        .map_err(Error::sql("forget the slot's published tables"))?;
    Ok(())
}
