//! Where and when walbox stopped for publication drift
//! (`walbox.drift_stops`): the rows inserted while the publication did not
//! cover the outbox table never entered the stream, and this record is
//! what republishing them starts from ([`crate::backfill::heal_drift`]).
//!
//! One row per slot. A second stop before the first was healed keeps the
//! earlier position and commit time: republishing from the earliest gap
//! covers the later ones. The record is deleted in the transaction that
//! copies the rows to republish, so a heal is begun exactly once.

use pgoutput_decoder::{Lsn, PgTimestamp};
use slot_manager::Error;
use tokio_postgres::Client;

use crate::bookkeeping;

/// The table, created on first use (see [`crate::bookkeeping`]).
const TABLE: &str = "
CREATE TABLE IF NOT EXISTS walbox.drift_stops (
    slot text PRIMARY KEY,
    held_lsn pg_lsn NOT NULL,
    committed_at timestamptz,
    stopped_at timestamptz NOT NULL DEFAULT now(),
    reason text NOT NULL
);
GRANT SELECT ON walbox.drift_stops TO PUBLIC;";

/// A recorded stop for drift.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriftStop {
    /// Where the slot was held.
    pub held: Lsn,
    /// The commit time of the newest transaction delivered before the
    /// stop, in µs since the Unix epoch; `None` when walbox knew none.
    pub committed_micros: Option<i64>,
    /// When walbox stopped, as text.
    pub stopped_at: String,
    /// What walbox found.
    pub reason: String,
}

impl DriftStop {
    /// The time republishing starts from: the commit time less `margin`
    /// (to the millisecond below), as a timestamp Postgres reads; `None`
    /// when the commit time is unknown.
    pub fn since(&self, margin: std::time::Duration) -> Option<String> {
        let margin = i64::try_from(margin.as_micros()).unwrap_or(i64::MAX);
        let micros = self.committed_micros?.saturating_sub(margin);
        Some(crate::mapping::timestamp::rfc3339_ms(
            micros.div_euclid(1000),
        ))
    }
}

/// Records that `slot` stopped for drift at `held`, after delivering
/// transactions up to one committed at `committed` (`None`: unknown, then
/// the saved position's time is taken, if any); creates the table on first
/// use.
pub async fn record(
    client: &Client,
    slot: &str,
    held: Lsn,
    committed: Option<PgTimestamp>,
    reason: &str,
) -> Result<(), Error> {
    let committed_micros = match committed {
        Some(t) => Some(t.as_unix_micros()),
        None => bookkeeping::positions::select(
            client,
            "(extract(epoch FROM committed_at) * 1000000)::int8",
            &[&slot],
        )
        .await?
        .map(|r| r.get::<_, i64>(0)),
    };
    // An unknown time stays unknown: the earliest gap may be before any
    // time known.
    let upsert = "INSERT INTO walbox.drift_stops (slot, held_lsn, committed_at, reason)
                  VALUES ($1, $2::text::pg_lsn, to_timestamp($3::int8 / 1000000.0), $4)
                  ON CONFLICT (slot) DO UPDATE SET
                      held_lsn = LEAST(walbox.drift_stops.held_lsn, EXCLUDED.held_lsn),
                      committed_at = CASE
                          WHEN walbox.drift_stops.committed_at IS NULL
                            OR EXCLUDED.committed_at IS NULL THEN NULL
                          ELSE LEAST(walbox.drift_stops.committed_at, EXCLUDED.committed_at) END";
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
        [&slot, &held.to_string(), &committed_micros, &reason];
    if !bookkeeping::exist(client, &["walbox.drift_stops"]).await? {
        bookkeeping::create(client, TABLE, "create walbox.drift_stops").await?;
    }
    client
        .execute(upsert, &params)
        .await
        .map_err(Error::sql("record the drift stop in walbox.drift_stops"))?;
    Ok(())
}

/// The recorded drift stop of `slot`, if any (or no table at all).
pub async fn load(client: &Client, slot: &str) -> Result<Option<DriftStop>, Error> {
    if !bookkeeping::exist(client, &["walbox.drift_stops"]).await? {
        return Ok(None);
    }
    let row = client
        .query_opt(
            "SELECT held_lsn::text, (extract(epoch FROM committed_at) * 1000000)::int8,
                    stopped_at::text, reason
               FROM walbox.drift_stops WHERE slot = $1",
            &[&slot],
        )
        .await
        .map_err(Error::sql("read walbox.drift_stops"))?;
    Ok(row.map(|r| DriftStop {
        held: r.get::<_, String>(0).parse().unwrap_or(Lsn::ZERO),
        committed_micros: r.get(1),
        stopped_at: r.get(2),
        reason: r.get(3),
    }))
}

/// The statement that forgets `slot`'s drift stop (`$1`): run in the
/// transaction that copies the rows republishing it.
pub const FORGET: &str = "DELETE FROM walbox.drift_stops WHERE slot = $1";

/// Forgets `slot`'s drift stop (when its slot is dropped).
pub async fn forget(client: &Client, slot: &str) -> Result<(), Error> {
    if !bookkeeping::exist(client, &["walbox.drift_stops"]).await? {
        return Ok(());
    }
    client
        .execute(FORGET, &[&slot])
        .await
        .map_err(Error::sql("forget the slot's drift stop"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn republishing_starts_the_margin_before_the_commit_rounded_down() {
        let stop = |committed_micros| DriftStop {
            held: Lsn::ZERO,
            committed_micros,
            stopped_at: String::new(),
            reason: String::new(),
        };
        // 2026-11-25 14:45:46.290909 UTC.
        let committed = Some(1_795_617_946_290_909);
        let margin = std::time::Duration::from_secs(600);
        assert_eq!(
            stop(committed).since(margin).as_deref(),
            Some("2026-11-25T14:35:46.290Z")
        );
        assert_eq!(
            stop(committed).since(std::time::Duration::ZERO).as_deref(),
            Some("2026-11-25T14:45:46.290Z")
        );
        assert_eq!(stop(None).since(margin), None);
    }
}
