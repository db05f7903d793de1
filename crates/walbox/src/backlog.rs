//! Back-pressure the application can see: every second while it streams,
//! `walbox run` writes to `walbox.relay_state` the commit time of the
//! oldest event the broker has not acknowledged and its budget
//! (`backlog.max_bytes`, `backlog.max_age`), then the verdict of
//! `walbox.backlog()` over them, which `walbox.require_capacity()`
//! (migration 0007) reads with one lookup, and the
//! `walbox_backlog_over_budget` gauge shows: the function and the metric
//! never disagree. No report for 5 s reads as nothing streaming.
//!
//! A report that fails is said once and tried again: the relay never
//! waits on it.

use std::sync::Arc;
use std::time::Duration;

use slot_manager::PgConfig;
use tokio_postgres::Client;

use crate::metrics::Metrics;

/// `backlog.*`: what `walbox.require_capacity()` holds the relay to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Budget {
    /// WAL written since the slot's confirmed position, at most.
    pub max_bytes: Option<u64>,
    /// The age of the oldest undelivered event, at most.
    pub max_age: Option<Duration>,
}

impl Budget {
    /// Whether any budget is set.
    pub fn is_set(&self) -> bool {
        self.max_bytes.is_some() || self.max_age.is_some()
    }
}

/// How often the state is written.
const EVERY: Duration = Duration::from_secs(1);

/// What a budget without the functions installed is refused with.
pub const NOT_INSTALLED: &str = "backlog.max_bytes and backlog.max_age are enforced by walbox.require_capacity(), which walbox migrate installs (migration 0007_backlog.sql): run walbox migrate, or apply it yourself";

/// Whether migration 0007 is installed.
pub async fn installed(client: &Client) -> Result<bool, slot_manager::Error> {
    crate::bookkeeping::exist(client, &["walbox.relay_state"]).await
}

/// Writes the state of `slot` every second, until aborted; ends at once
/// where migration 0007 is not installed (a budget was refused at start
/// there, see [`NOT_INSTALLED`]).
pub async fn run(pg: PgConfig, slot: String, budget: Budget, metrics: Arc<Metrics>) {
    let mut client: Option<Client> = None;
    let mut failing = false;
    let mut looked = false;
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if client.as_ref().is_none_or(Client::is_closed) {
            client = slot_manager::connect_control(&pg).await.ok();
        }
        let Some(c) = &client else {
            continue;
        };
        // Only the walbox streaming from the slot reports: a standby of an
        // active/standby pair (or one reconnecting) must not overwrite it,
        // and its silence past 5 s is what require_capacity() reads as
        // nothing streaming.
        if !metrics.is_streaming() {
            continue;
        }
        if !looked {
            match installed(c).await {
                Ok(true) => looked = true,
                Ok(false) => {
                    tracing::debug!("walbox.relay_state is not installed (walbox migrate): the backlog is not reported");
                    return;
                }
                Err(_) => continue,
            }
        }
        let report = tokio::time::timeout(EVERY * 5, report(c, &slot, budget, &metrics)).await;
        match report {
            Ok(Ok(over)) => {
                metrics.backlog_over_budget.set(i64::from(over));
                if std::mem::take(&mut failing) {
                    tracing::info!(slot, "reporting the backlog to walbox.relay_state again");
                }
            }
            Ok(Err(e)) => {
                if !std::mem::replace(&mut failing, true) {
                    let denied =
                        e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE);
                    let error = crate::redaction::redact(&e.to_string()).into_owned();
                    match denied {
                        true => {
                            tracing::warn!(slot, %error, "could not report the backlog: walbox's role may not write walbox.relay_state, so walbox.require_capacity() refuses every write as if no walbox streamed (GRANT INSERT, UPDATE ON walbox.relay_state TO <walbox's role>)")
                        }
                        false => {
                            tracing::warn!(slot, %error, "could not report the backlog to walbox.relay_state: past 5 s without a report, walbox.require_capacity() refuses writes as if no walbox streamed")
                        }
                    }
                }
            }
            Err(_) => {
                client = None;
            }
        }
    }
}

/// One report; whether the slot is over its budget.
async fn report(
    client: &Client,
    slot: &str,
    budget: Budget,
    metrics: &Metrics,
) -> Result<bool, tokio_postgres::Error> {
    let oldest = metrics.oldest_unacked_micros();
    let max_bytes = budget
        .max_bytes
        .map(|b| i64::try_from(b).unwrap_or(i64::MAX));
    let max_age_secs = budget.max_age.map(|d| d.as_secs_f64());
    client
        .execute(
            "INSERT INTO walbox.relay_state (slot, reported_at, oldest_undelivered, max_bytes, max_age)
             VALUES ($1, now(), to_timestamp($2::int8 / 1000000.0), $3, $4::float8 * interval '1 second')
             ON CONFLICT (slot) DO UPDATE SET reported_at = EXCLUDED.reported_at,
                 oldest_undelivered = EXCLUDED.oldest_undelivered,
                 max_bytes = EXCLUDED.max_bytes, max_age = EXCLUDED.max_age",
            &[&slot, &oldest, &max_bytes, &max_age_secs],
        )
        .await?;
    let row = client
        .query_one(
            "UPDATE walbox.relay_state
                SET over_budget = coalesce((SELECT over_budget FROM walbox.backlog($1)), false)
              WHERE slot = $1
          RETURNING over_budget",
            &[&slot],
        )
        .await?;
    Ok(row.get(0))
}
