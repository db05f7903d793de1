//! `walbox audit`: compares a window of the outbox table with what the
//! broker holds (see [`crate::audit`]) and prints what it found. Exit
//! status: 0 clean, 1 findings, 2 a configuration or usage error, 3 the
//! audit could not be made (Postgres or the broker unreachable, a slot
//! gone).

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

use super::{loaded, CliError};
use crate::audit::findings::Counts;
use crate::audit::{audit, AuditError, AuditPlan, Progress, Report, WindowSpec};
use crate::readback::Readback;

/// Event types listed in the text report (the JSON one lists them all).
const TYPES_SHOWN: usize = 20;
use crate::config::{ConfigError, EventSource, RunFlags};

/// Arguments of `walbox audit`.
#[derive(Debug, clap::Args)]
pub struct AuditArgs {
    #[command(flatten)]
    settings: RunFlags,
    /// Audit the rows whose timestamp column (mapping.timestamp) is at or
    /// after this time, e.g. "2026-11-25 08:00:00+00" (without an offset:
    /// UTC).
    #[arg(
        long,
        value_name = "TIME",
        conflicts_with = "last",
        required_unless_present = "last"
    )]
    since: Option<String>,
    /// … and before this time (default: now).
    #[arg(long, value_name = "TIME", requires = "since")]
    until: Option<String>,
    /// Audit the last so long, up to now, e.g. "15m", "24h".
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    last: Option<Duration>,
    /// When rows have no copy on the broker: how long to wait for the slot
    /// to be confirmed past the audit's snapshot before reading the topics
    /// again. Rows still without a copy then are missing; if the slot did
    /// not get there, they may be in flight and count as unconfirmed.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    wait: Duration,
    /// Memory for the audit's sorts, in MiB, all three together; beyond it
    /// they spill to temporary files (about 100 bytes per row and per
    /// record). The process adds the Kafka consumer's buffers (16 MiB) on
    /// Kafka.
    #[arg(long, value_name = "MIB", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    memory: u64,
    /// Findings listed per kind.
    #[arg(long, value_name = "N", default_value_t = 20)]
    examples: usize,
    /// Read the topics from their first record instead of finding the
    /// window's start with the brokers' time index: for brokers that have
    /// none (librdkafka's MockCluster). Reads every record the topics hold.
    #[arg(long)]
    from_beginning: bool,
    /// Print the report as one JSON document.
    #[arg(long)]
    json: bool,
}

/// Runs the audit and prints its report.
pub async fn run(args: AuditArgs) -> Result<(), CliError> {
    let config = loaded(args.settings.load())?;
    let c = config.connection()?;
    let mapping = config.mapping()?;
    let settings = config.run()?;
    if c.source == EventSource::Messages {
        return Err(ConfigError(
            "the audit compares the outbox table with the topics; with source = messages events are in no table".into(),
        )
        .into());
    }
    let window = match (args.since, args.last) {
        (Some(since), _) => WindowSpec::Between {
            since,
            until: args.until,
        },
        (None, Some(last)) => WindowSpec::Last(last),
        // clap requires one of them; said again rather than assumed.
        (None, None) => {
            return Err(
                ConfigError("give the window: --since TIME or --last DURATION".into()).into(),
            )
        }
    };
    let readback = Readback::of(&settings.sink).map_err(|why| {
        ConfigError(format!(
            "walbox audit reads the events back from the broker; with sink = \"{}\" it cannot: {why}",
            settings.sink.name()
        ))
    })?;
    let progress = Arc::new(Progress::default());
    let shown = (std::io::stderr().is_terminal() && !args.json)
        .then(|| tokio::spawn(show_progress(Arc::clone(&progress))));
    let slots = c.all_shards().into_iter().map(|s| s.slot).collect();
    let result = audit(AuditPlan {
        pg: &c.pg,
        slots,
        table: c.table("walbox audit")?,
        mapping: &mapping,
        readback: &readback,
        dead_letter_topic: settings.dead_letters.topic(),
        window,
        wait: args.wait,
        memory: (args.memory as usize).saturating_mul(1 << 20),
        max_examples: args.examples,
        retention: settings.retention,
        check_unknown: c.source == EventSource::Table,
        from_beginning: args.from_beginning,
        progress,
    })
    .await;
    if let Some(task) = shown {
        task.abort();
        eprint!("\r\x1b[K");
    }
    let report = result.map_err(|e| match e {
        AuditError::Config(m) => CliError::Config(ConfigError(m)),
        other => CliError::Audit(other),
    })?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report)
                .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
        );
    } else {
        print!("{}", text(&report));
    }
    match report.findings() {
        0 => Ok(()),
        n => Err(CliError::Findings(n)),
    }
}

/// One line on a terminal, rewritten as the audit moves.
async fn show_progress(progress: Arc<Progress>) {
    use std::sync::atomic::Ordering;
    loop {
        let stage = progress.stage.lock().map(|s| *s).unwrap_or("auditing");
        eprint!(
            "\r\x1b[K{stage}: {} rows, {} records",
            thousands(progress.rows.load(Ordering::Relaxed)),
            thousands(progress.records.load(Ordering::Relaxed)),
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `1234567` → `1,234,567`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// The report for a person.
pub fn text(r: &Report) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let t = &r.findings.total;
    let _ = writeln!(
        out,
        "walbox audit of {} from {} to {}",
        r.table, r.since, r.until
    );
    for s in &r.slots {
        let _ = writeln!(
            out,
            "  slot {:?} confirmed at {} (the table was read at {})",
            s.slot,
            s.confirmed.as_deref().unwrap_or("(none)"),
            r.snapshot_lsn
        );
    }
    let _ = writeln!(
        out,
        "  table: {} rows (per-key order: {}); topics: {} records read from {}",
        thousands(t.rows),
        r.order,
        thousands(r.records_read),
        if r.topics.is_empty() {
            "no topic".to_owned()
        } else {
            r.topics.join(", ")
        }
    );
    if !r.slots_caught_up {
        let _ = writeln!(
            out,
            "  warning: the slot was not confirmed past the table's snapshot within --wait: {} rows without a copy are counted as unconfirmed (maybe in flight), not missing",
            thousands(t.unconfirmed)
        );
    }
    for p in &r.truncated_partitions {
        let _ = writeln!(
            out,
            "  warning: {} [{}] begins at offset {}: records before it were deleted (retention, DeleteRecords); window events there show as missing",
            p.topic, p.partition, p.first_offset
        );
    }
    for topic in &r.absent_topics {
        let _ = writeln!(out, "  warning: topic {topic} does not exist");
    }
    if r.rows_without_id > 0 {
        let _ = writeln!(
            out,
            "  note: {} rows have no event id and cannot be checked",
            thousands(r.rows_without_id)
        );
    }
    if r.records_without_id > 0 {
        let _ = writeln!(
            out,
            "  note: {} records on the topics have no `id` header (not written by walbox) and were not checked",
            thousands(r.records_without_id)
        );
    }
    if !r.unknown_checked {
        let _ = writeln!(
            out,
            "  note: events emitted as messages are in no table: records the table does not hold were not looked for"
        );
    }
    let _ = writeln!(out);
    let header = [
        "event type",
        "rows",
        "delivered",
        "dead-lettered",
        "missing",
        "duplicates",
        "out of order",
        "unknown",
        "misrouted",
    ];
    // The event types with the most findings, then the most rows.
    let mut types: Vec<(&String, &Counts)> = r.findings.by_event_type.iter().collect();
    types.sort_by_key(|(_, c)| std::cmp::Reverse((c.findings(), c.rows)));
    let hidden = types.len().saturating_sub(TYPES_SHOWN);
    let mut rows: Vec<[String; 9]> = types
        .into_iter()
        .take(TYPES_SHOWN)
        .map(|(name, c)| cells(name, c))
        .collect();
    rows.push(cells("total", t));
    let widths: Vec<usize> = (0..9)
        .map(|i| {
            rows.iter()
                .map(|row| row[i].chars().count())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cols: &[String]| -> String {
        let mut l = format!("  {:<w$}", cols[0], w = widths[0]);
        for (i, c) in cols.iter().enumerate().skip(1) {
            let _ = write!(l, "  {:>w$}", c, w = widths[i]);
        }
        l
    };
    let _ = writeln!(out, "{}", line(&header.map(str::to_owned)));
    for row in &rows {
        let _ = writeln!(out, "{}", line(row));
    }
    if hidden > 0 {
        let _ = writeln!(
            out,
            "  (and {} more event types: --json lists them all)",
            thousands(hidden as u64)
        );
    }
    let _ = writeln!(out);
    match r.findings() {
        0 => {
            let _ = writeln!(out, "no findings");
        }
        n => {
            let _ = writeln!(out, "{} findings:", thousands(n));
            for e in &r.findings.examples {
                let mut l = format!("  {:<12} id {}", e.kind, e.id);
                if let Some(topic) = &e.topic {
                    let _ = write!(l, ", topic {topic}");
                }
                if let Some(key) = &e.key {
                    let _ = write!(l, ", key {key:?}");
                }
                if let (Some(p), Some(o)) = (e.partition, e.offset) {
                    let _ = write!(l, ", partition {p} offset {o}");
                }
                let _ = write!(l, ", event type {}", e.event_type);
                let _ = writeln!(out, "{l}");
            }
        }
    }
    out
}

fn cells(name: &str, c: &Counts) -> [String; 9] {
    [
        name.to_owned(),
        thousands(c.rows),
        thousands(c.delivered),
        thousands(c.dead_lettered),
        thousands(c.missing),
        thousands(c.duplicates),
        thousands(c.out_of_order),
        thousands(c.unknown),
        thousands(c.misrouted),
    ]
}

#[cfg(test)]
mod tests {
    use super::thousands;

    #[test]
    fn figures_are_grouped_by_thousands() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }
}
