//! `walbox status`: the slot, who streams from it, how far behind it is,
//! and whether the publication still covers the outbox, as text or JSON.

use serde::Serialize;
use slot_manager::{connect_control, coverage, message_coverage, slot_status};

use super::{loaded, CliError};
use crate::config::ConnectionFlags;

/// Arguments of `walbox status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Print one JSON object instead of text (field names as in the text);
    /// on failure, `{"error": "...", "kind": "no_slot" | "configuration" |
    /// "postgres" | "other"}` (and a non-zero exit status).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    settings: ConnectionFlags,
}

/// What `status` reports. `None` is `null` in JSON and `-` in text.
#[derive(Debug, Serialize)]
struct Status {
    slot: String,
    /// `"i of N"` when sharded.
    shard: Option<String>,
    active: bool,
    /// The Postgres backend (walsender) serving the slot, not walbox's own
    /// pid. `active_pid` is its old name, kept for scripts.
    walsender_pid: Option<i32>,
    active_pid: Option<i32>,
    /// Who streams: the walbox process's `application_name` (the pod's
    /// name under the Helm chart) and the address it connects from.
    application_name: Option<String>,
    client_addr: Option<String>,
    confirmed_flush_lsn: Option<String>,
    restart_lsn: Option<String>,
    /// WAL written since the confirmed position.
    confirmed_lag_bytes: Option<i64>,
    /// `pg_stat_replication.flush_lag` of the streaming process.
    confirmed_lag_seconds: Option<f64>,
    retained_wal_bytes: Option<i64>,
    wal_status: Option<String>,
    /// `None`: unlimited.
    safe_wal_size: Option<i64>,
    invalidation_reason: Option<String>,
    publication: String,
    /// Whether the publication publishes what the source needs: the outbox
    /// table's INSERTs (`source = table`/`both`), or exists (`messages`).
    publication_covers: bool,
    /// Why not, with the fix.
    publication_problem: Option<String>,
    saved_position: Option<String>,
    backfill: Option<String>,
    /// A stop for publication drift not yet healed: where, when, why.
    drift_stop: Option<String>,
    /// What `on_failure = "quarantine"` holds: aggregates and events.
    quarantined: Option<String>,
}

/// Prints the slot's state; with shards and no `shard`, every shard's (in
/// JSON, `{"shards": [...]}`). With `--json`, a failure is a JSON object on
/// stdout too (`{"error": …, "kind": …}`), besides the line on stderr and
/// the non-zero exit status, so a script reading stdout never reads nothing.
pub async fn run(args: StatusArgs) -> Result<(), CliError> {
    let json = args.json;
    let result = report(args).await;
    if let (true, Err(e)) = (json, &result) {
        let kind = match e {
            CliError::NoSlot(_) => "no_slot",
            CliError::Config(_) => "configuration",
            CliError::Postgres(_) => "postgres",
            _ => "other",
        };
        println!(
            "{}",
            serde_json::json!({ "error": e.to_string(), "kind": kind })
        );
    }
    result
}

async fn report(args: StatusArgs) -> Result<(), CliError> {
    let config = loaded(args.settings.load())?;
    let base = config.connection()?;
    let client = connect_control(&base.pg).await?;
    let every = base.selected_shards();
    let mut statuses = Vec::with_capacity(every.len());
    for c in &every {
        statuses.push(status(&client, c).await?);
    }
    let all = every.len() > 1;
    if args.json {
        let json = if all {
            serde_json::json!({ "shards": statuses }).to_string()
        } else {
            serde_json::to_string(&statuses[0]).expect("plain data serializes")
        };
        println!("{json}");
    } else {
        let blocks: Vec<String> = statuses.iter().map(text).collect();
        print!("{}", blocks.join("\n"));
    }
    Ok(())
}

/// One slot's state.
async fn status(
    client: &tokio_postgres::Client,
    c: &crate::config::Connection,
) -> Result<Status, CliError> {
    let st = slot_status(client, &c.slot)
        .await?
        .ok_or_else(|| CliError::NoSlot(c.slot.clone()))?;
    let covered = if !c.source.table() {
        message_coverage(client, &c.publication).await?
    } else if let Some(table) = c.tables.single() {
        coverage(client, &c.publication, table, c.shard.as_ref()).await?
    } else {
        let published = c.tables.published(client, &c.publication).await?;
        slot_manager::CoverageReader::default()
            .read_tables(client, &c.publication, &published)
            .await?
    };
    let saved = crate::bookkeeping::positions::saved(client, &c.slot)
        .await?
        .map(|(lsn, committed, saved)| format!("{lsn} (commit {committed}, saved {saved})"));
    Ok(Status {
        slot: c.slot.clone(),
        shard: c
            .shard
            .as_ref()
            .map(|s| format!("{} of {}", s.index, s.count)),
        active: st.active,
        walsender_pid: st.active_pid,
        active_pid: st.active_pid,
        application_name: st.application_name,
        client_addr: st.client_addr,
        confirmed_flush_lsn: st.confirmed_flush_lsn.map(|l| l.to_string()),
        restart_lsn: st.restart_lsn.map(|l| l.to_string()),
        confirmed_lag_bytes: st.confirmed_lag_bytes,
        confirmed_lag_seconds: st.confirmed_lag_seconds,
        retained_wal_bytes: st.retained_wal_bytes,
        wal_status: st.wal_status,
        safe_wal_size: st.safe_wal_size,
        invalidation_reason: st.invalidation_reason,
        publication: c.publication.clone(),
        publication_covers: covered.gap.is_none(),
        publication_problem: covered.gap,
        saved_position: saved,
        backfill: crate::bookkeeping::backfills::describe(client, &c.slot).await?,
        drift_stop: crate::bookkeeping::drift::load(client, &c.slot)
            .await?
            .map(|d| {
                format!(
                    "stopped at {} on {}, not healed: the rows inserted while the publication did not cover the table are not in the stream; `walbox resync --drift` republishes them ({})",
                    d.held, d.stopped_at, d.reason
                )
            }),
        quarantined: quarantined(client, &c.slot).await?,
    })
}

/// What the slot's quarantine holds, if anything.
async fn quarantined(
    client: &tokio_postgres::Client,
    slot: &str,
) -> Result<Option<String>, CliError> {
    let held = crate::bookkeeping::quarantine::list(client, slot).await?;
    if held.is_empty() {
        return Ok(None);
    }
    let events: u64 = held.iter().map(|h| h.events).sum();
    Ok(Some(format!(
        "{} aggregates, {events} events held (walbox quarantine list)",
        held.len()
    )))
}

/// The text form: `name: value` lines, aligned.
fn text(s: &Status) -> String {
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let active = match s.walsender_pid {
        Some(pid) => format!(
            "yes: streamed by {} from {} (walsender pid {pid})",
            s.application_name
                .as_deref()
                .filter(|n| !n.is_empty())
                .unwrap_or("a process without application_name"),
            s.client_addr.as_deref().unwrap_or("a local socket"),
        ),
        None => "no".into(),
    };
    let lag = match (s.confirmed_lag_bytes, s.confirmed_lag_seconds) {
        (Some(b), Some(secs)) => format!("{b} bytes, {secs:.3} s"),
        (Some(b), None) => format!("{b} bytes"),
        (None, _) => "-".into(),
    };
    let covers = match &s.publication_problem {
        None => "yes".to_owned(),
        Some(problem) => format!("NO: {problem}"),
    };
    let mut rows = vec![
        ("slot", s.slot.clone()),
        ("shard", opt(s.shard.clone())),
        ("active", active),
        ("confirmed_flush_lsn", opt(s.confirmed_flush_lsn.clone())),
        ("confirmed_lag", lag),
        ("restart_lsn", opt(s.restart_lsn.clone())),
        (
            "retained_wal_bytes",
            opt(s.retained_wal_bytes.map(|b| b.to_string())),
        ),
        ("wal_status", opt(s.wal_status.clone())),
        (
            "safe_wal_size",
            s.safe_wal_size
                .map_or_else(|| "unlimited".into(), |b| b.to_string()),
        ),
    ];
    if let Some(reason) = &s.invalidation_reason {
        rows.push(("invalidation_reason", reason.clone()));
    }
    rows.push((
        "publication",
        format!("{} (covers: {covers})", s.publication),
    ));
    if let Some(saved) = &s.saved_position {
        rows.push(("saved position", saved.clone()));
    }
    if let Some(backfill) = &s.backfill {
        rows.push(("backfill", backfill.clone()));
    }
    if let Some(drift) = &s.drift_stop {
        rows.push(("drift stop", drift.clone()));
    }
    if let Some(held) = &s.quarantined {
        rows.push(("quarantine", held.clone()));
    }
    rows.iter()
        .map(|(k, v)| format!("{:21}{v}\n", format!("{k}:")))
        .collect()
}
