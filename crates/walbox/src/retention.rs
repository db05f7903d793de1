//! Retention (`retention = "7d"`): keeps the outbox small, only behind what
//! was delivered.
//!
//! walbox never reads the outbox to find work: an event is in the WAL once
//! its transaction commits. The rows matter afterwards only as the safety
//! net of [`crate::backfill::heal`] and `walbox resync`. So a row may go
//! once it is older than the retention **and** its transaction was
//! delivered: its timestamp is before the commit time of the newest
//! delivered transaction (saved in `walbox.positions`, see
//! [`crate::bookkeeping::positions`]) less the recreate margin.
//! Until walbox saved a position, nothing is removed.
//!
//! Two ways, chosen by the table:
//! - a plain table: `DELETE` in chunks of [`CHUNK`] rows, each statement
//!   bounded by a 5 s `statement_timeout` and a 1 s `lock_timeout`, paced
//!   [`PACE`] apart, on a connection of its own (the streaming path never
//!   waits for it). Deleted rows are dead tuples until VACUUM.
//! - a table partitioned by RANGE on the timestamp column: whole partitions
//!   whose upper bound is at or before the cutoff are dropped (no dead
//!   tuples, no VACUUM), and partitions of the newest one's width are
//!   created ahead, so inserts always find one.

use std::sync::Arc;
use std::time::Duration;

use slot_manager::{connect_control, quote_ident, Error, PgConfig, TableName};
use tokio_postgres::Client;

use crate::metrics::Metrics;

/// Rows deleted per statement.
pub const CHUNK: i64 = 5_000;
/// The pause between two chunks.
pub const PACE: Duration = Duration::from_millis(100);
/// Partitions kept ready ahead of now, in partition widths.
const AHEAD: i32 = 3;
/// At most this many partitions are created in one round.
const MAX_CREATED_PER_ROUND: usize = 100;

/// What to keep, and where.
#[derive(Clone, Debug)]
pub struct Retention {
    /// The connection settings.
    pub pg: PgConfig,
    /// The slots whose saved positions bound what may go: this one, or
    /// with shards, every shard's (rows of every shard are in the table).
    pub slots: Vec<String>,
    /// The outbox table.
    pub table: TableName,
    /// Its timestamp column.
    pub column: String,
    /// Rows younger than this stay.
    pub keep: Duration,
    /// And rows within this of the newest delivered commit.
    pub margin: Duration,
}

/// How often a round runs: a quarter of the retention, within 1 s..60 s.
pub fn interval(keep: Duration) -> Duration {
    (keep / 4).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

impl Retention {
    /// Runs rounds until the task is aborted. Failures are logged once per
    /// streak and never stop walbox.
    pub async fn run(self, metrics: Arc<Metrics>) {
        let mut client: Option<Client> = None;
        let mut failing = false;
        let mut tick = tokio::time::interval(interval(self.keep));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match self.connected_round(&mut client, &metrics).await {
                Ok(()) if failing => {
                    failing = false;
                    tracing::info!("retention works again");
                }
                Ok(()) => {}
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, "retention failed; outbox rows are kept (retried every round)");
                    }
                    failing = true;
                    client = None;
                }
            }
        }
    }

    /// A round on `client`, connected first when it is not.
    async fn connected_round(
        &self,
        client: &mut Option<Client>,
        metrics: &Metrics,
    ) -> Result<(), Error> {
        if client.as_ref().is_none_or(Client::is_closed) {
            let c = connect_control(&self.pg).await?;
            c.batch_execute("SET statement_timeout = '5s'; SET lock_timeout = '1s'")
                .await
                .map_err(Error::sql("set the retention session's timeouts"))?;
            *client = Some(c);
        }
        match client {
            Some(c) => self.round(c, metrics).await,
            None => Ok(()),
        }
    }

    /// One round: deletes or drops what is past the cutoff.
    pub async fn round(&self, client: &Client, metrics: &Metrics) -> Result<(), Error> {
        let partitioned: Option<String> = client
            .query_opt(
                "SELECT CASE WHEN c.relkind = 'p' THEN pg_get_partkeydef(c.oid) END
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND c.relname = $2",
                &[&self.table.schema(), &self.table.name()],
            )
            .await
            .map_err(Error::sql("look up the outbox table"))?
            .and_then(|r| r.get(0));
        let cutoff = self.cutoff(client).await?;
        match partitioned {
            None => match cutoff {
                Some(cutoff) => self.delete(client, &cutoff, metrics).await,
                None => Ok(()),
            },
            Some(key) => {
                let expected = format!("RANGE ({})", quote_ident(&self.column));
                if key != expected && key != format!("RANGE ({})", self.column) {
                    return Err(Error::Precondition(format!(
                        "retention on a partitioned outbox needs it partitioned by RANGE on the timestamp column {:?}; {} is partitioned by {key}",
                        self.column, self.table
                    )));
                }
                // Inserts need a partition whether or not anything was
                // delivered yet.
                self.create_ahead(client, metrics).await?;
                match cutoff {
                    Some(cutoff) => self.drop_partitions(client, &cutoff, metrics).await,
                    None => Ok(()),
                }
            }
        }
    }

    /// The newest timestamp that may go, as text; `None` before every slot
    /// saved a delivered position.
    async fn cutoff(&self, client: &Client) -> Result<Option<String>, Error> {
        let row = crate::bookkeeping::positions::select_every(
            client,
            "least(now() - make_interval(secs => $2), min(committed_at) - make_interval(secs => $3))::text",
            &[&self.slots, &self.keep.as_secs_f64(), &self.margin.as_secs_f64()],
        )
        .await?;
        Ok(row.map(|r| r.get(0)))
    }

    async fn delete(&self, client: &Client, cutoff: &str, metrics: &Metrics) -> Result<(), Error> {
        let statement = format!(
            "DELETE FROM {t} WHERE ctid = ANY(ARRAY(
                 SELECT ctid FROM {t} WHERE {c} < $1::text::timestamptz LIMIT {CHUNK}))",
            t = self.table.quoted(),
            c = quote_ident(&self.column),
        );
        let mut total = 0u64;
        loop {
            let n = client
                .execute(&statement, &[&cutoff])
                .await
                .map_err(Error::sql("delete old outbox rows"))?;
            metrics.retention_rows_deleted.inc_by(n);
            total += n;
            if n < CHUNK as u64 {
                break;
            }
            tokio::time::sleep(PACE).await;
        }
        if total > 0 {
            tracing::debug!(rows = total, cutoff, "retention deleted outbox rows");
        }
        Ok(())
    }

    /// The partitions with timestamp bounds: (name, from, to), oldest first.
    async fn partitions(&self, client: &Client) -> Result<Vec<(String, String, String)>, Error> {
        let rows = client
            .query(
                "SELECT p.oid::regclass::text, b[1]::timestamptz::text, b[2]::timestamptz::text
                   FROM pg_inherits i
                   JOIN pg_class p ON p.oid = i.inhrelid
                   CROSS JOIN LATERAL regexp_match(pg_get_expr(p.relpartbound, p.oid),
                        '^FOR VALUES FROM \\(''([^'']+)''\\) TO \\(''([^'']+)''\\)$') AS b
                  WHERE i.inhparent = $1::text::regclass
                  ORDER BY b[2]::timestamptz",
                &[&self.table.quoted()],
            )
            .await
            .map_err(Error::sql("list the outbox partitions"))?;
        Ok(rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect())
    }

    async fn drop_partitions(
        &self,
        client: &Client,
        cutoff: &str,
        metrics: &Metrics,
    ) -> Result<(), Error> {
        for (name, _, to) in self.partitions(client).await? {
            let past: bool = client
                .query_one(
                    "SELECT $1::text::timestamptz <= $2::text::timestamptz",
                    &[&to, &cutoff],
                )
                .await
                .map_err(Error::sql("compare a partition's bound"))?
                .get(0);
            if !past {
                break;
            }
            // `name` is regclass text: already quoted where needed.
            client
                .batch_execute(&format!("DROP TABLE {name}"))
                .await
                .map_err(Error::sql("drop an old outbox partition"))?;
            metrics.retention_partitions_dropped.inc();
            tracing::info!(partition = %name, upper_bound = %to, "retention dropped an outbox partition");
        }
        Ok(())
    }

    /// Creates partitions as wide as the newest one until [`AHEAD`] widths
    /// past now are covered.
    async fn create_ahead(&self, client: &Client, metrics: &Metrics) -> Result<(), Error> {
        for _ in 0..MAX_CREATED_PER_ROUND {
            let Some((_, from, to)) = self.partitions(client).await?.pop() else {
                return Ok(());
            };
            let next = client
                .query_one(
                    "SELECT $2::text::timestamptz < now() + ($2::text::timestamptz - $1::text::timestamptz) * $3::int4,
                            ($2::text::timestamptz + ($2::text::timestamptz - $1::text::timestamptz))::text,
                            to_char($2::text::timestamptz AT TIME ZONE 'UTC', 'YYYYMMDD\"t\"HH24MISS')",
                    &[&from, &to, &AHEAD],
                )
                .await
                .map_err(Error::sql("plan the next outbox partition"))?;
            let (needed, upper, suffix): (bool, String, String) =
                (next.get(0), next.get(1), next.get(2));
            if !needed {
                return Ok(());
            }
            let mut base = self.table.name().to_owned();
            let room = slot_manager::MAX_NAME_BYTES.saturating_sub(suffix.len() + 2);
            while base.len() > room {
                base.pop();
            }
            let name = format!("{base}_p{suffix}");
            client
                .batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS {schema}.{name} PARTITION OF {table} FOR VALUES FROM ({from}) TO ({upper})",
                    schema = quote_ident(self.table.schema()),
                    name = quote_ident(&name),
                    table = self.table.quoted(),
                    from = slot_manager::quote_literal(&to),
                    upper = slot_manager::quote_literal(&upper),
                ))
                .await
                .map_err(Error::sql("create an outbox partition ahead"))?;
            metrics.retention_partitions_created.inc();
            tracing::info!(partition = %name, from = %to, to = %upper, "retention created an outbox partition ahead");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_run_a_quarter_of_the_retention_apart_within_bounds() {
        assert_eq!(interval(Duration::from_secs(2)), Duration::from_secs(1));
        assert_eq!(interval(Duration::from_secs(120)), Duration::from_secs(30));
        assert_eq!(
            interval(Duration::from_secs(7 * 86_400)),
            Duration::from_secs(60)
        );
    }
}
