//! The "Results" section of docs/benchmarks.md (walbox's own figures on
//! Apache Kafka: exactly-once, shards, what writing and keeping events
//! costs the primary) and its retention section.

use std::fmt::Write;

use super::heading;
use crate::alone::{
    AUDIT_MEMORY, AUDIT_WAYS, BROKERS, CLEANUP_WAYS, RETENTION_WAYS, SHARDS, WRITE_WAYS,
};
use crate::relay::Kind;
use crate::results::Results;
use crate::Scale;

/// The phases of the section.
pub(crate) const PHASES: [&str; 4] = ["eos", "shards", "writecost", "cleanup"];
/// The phases of the audit section.
pub(crate) const AUDIT_PHASES: [&str; 1] = ["audit"];
/// The phases of the brokers section.
pub(crate) const BROKERS_PHASES: [&str; 1] = ["brokers"];
/// The phases of the retention section.
pub(crate) const RETENTION_PHASES: [&str; 1] = ["retention"];

pub(crate) fn section(r: &Results, scale: Scale) -> String {
    let mut s = heading(scale);
    eos(&mut s, r, scale);
    shards(&mut s, r);
    write_cost(&mut s, r, scale);
    cleanup(&mut s, r);
    s
}

fn eos(s: &mut String, r: &Results, scale: Scale) {
    if !r.has("eos", "events") {
        return;
    }
    let _ = writeln!(
        s,
        "### Exactly-once beside at-least-once: {} events of ~200 bytes in transactions of 100, each mode from its own slot, on Apache Kafka's transactions\n",
        r.stat("eos", "events", 0, "")
    );
    let _ = writeln!(s, "| delivery | until its first record | then until the slot confirmed the backlog | events/s | CPU s | CPU µs per event | peak RSS MiB | duplicates read back (`read_committed`) |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    let modes = [
        (Kind::Walbox, "at-least-once"),
        (Kind::WalboxExactlyOnce, "**exactly-once**"),
    ];
    for (kind, label) in modes {
        let m = |x: &str| format!("{}_{x}", kind.slot());
        let _ = writeln!(
            s,
            "| {label} | {} | {} | {} | {} | {} | {} | {} |",
            r.stat("eos", &m("start_s"), 2, " s"),
            r.stat("eos", &m("stream_s"), 2, " s"),
            r.stat("eos", &m("eps"), 0, ""),
            r.stat("eos", &m("cpu_s"), 2, ""),
            r.stat("eos", &m("cpu_us"), 2, ""),
            r.stat("eos", &m("rss_mib"), 0, ""),
            r.stat("eos", &m("duplicates"), 0, ""),
        );
    }
    let ratio = r
        .ratio("eos", "walbox_eos_eps", "walbox_eps")
        .map_or("–".into(), |x| format!("{x:.2}"));
    let _ = writeln!(
        s,
        "\nexactly-once / at-least-once, events/s: **{ratio}x** (target ≥ 0.8x). One Postgres transaction of {} rows in exactly-once mode (split into Kafka transactions of at most 10,000 events): {} until the slot confirmed it, peak RSS {} MiB.\n",
        r.stat("eos", "huge_events", 0, ""),
        r.stat("eos", "huge_walbox_eos_s", 2, " s"),
        r.stat("eos", "huge_walbox_eos_rss_mib", 0, ""),
    );
    let _ = writeln!(
        s,
        "Latency, {} s at each rate, one event per Postgres transaction:\n",
        scale.curve_seconds()
    );
    let _ = writeln!(s, "| delivery | events/s | commit → ack p50 | p99 | p99.9 | max | commit → read p50 | p99 | Kafka transactions | broker CPU s |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for (kind, label) in modes {
        for rate in [100, 1_000, 5_000] {
            let l = |x: &str| format!("{}_{rate}_{x}", kind.slot());
            if !r.has("eos", &l("p50_ms")) {
                continue;
            }
            let _ = writeln!(
                s,
                "| {label} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.stat("eos", &l("eps"), 0, ""),
                r.stat("eos", &l("p50_ms"), 1, " ms"),
                r.stat("eos", &l("p99_ms"), 1, " ms"),
                r.stat("eos", &l("p999_ms"), 1, " ms"),
                r.stat("eos", &l("max_ms"), 1, " ms"),
                r.stat("eos", &l("read_p50_ms"), 1, " ms"),
                r.stat("eos", &l("read_p99_ms"), 1, " ms"),
                if r.has("eos", &l("commits")) {
                    r.stat("eos", &l("commits"), 0, "")
                } else {
                    "–".into()
                },
                r.stat("eos", &l("broker_cpu_s"), 2, ""),
            );
        }
    }
    let _ = writeln!(s, "\nCommit → ack and commit → read are walbox's own exact histograms over every event of the run (`commit to ack since start (exact)`, logged when it stops): in exactly-once mode an event counts when its Kafka transaction committed. A walbox process per rate, measured once a probe event was confirmed (in exactly-once mode: committed), so its producer's start is not in the figures; a 5 s run before them, not measured, warms the broker's transaction coordinator up. Broker CPU: the Kafka process's CPU seconds over the run.\n");
}

fn shards(s: &mut String, r: &Results) {
    if !r.has("shards", "events") {
        return;
    }
    let _ = writeln!(
        s,
        "### Sharded streaming: {} events of ~200 bytes drained by N shards (one slot, walsender and walbox process each)\n",
        r.stat("shards", "events", 0, "")
    );
    let _ = writeln!(s, "| shards | until every slot confirmed | events/s | walsenders' CPU s (all) | server CPU s (all processes) | walbox CPU s (all processes) |");
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for n in SHARDS {
        let m = |x: &str| format!("n{n}_{x}");
        let _ = writeln!(
            s,
            "| {n} | {} | {} | {} | {} | {} |",
            r.stat("shards", &m("s"), 2, " s"),
            r.stat("shards", &m("eps"), 0, ""),
            r.stat("shards", &m("walsender_cpu_s"), 2, ""),
            r.stat("shards", &m("pg_cpu_s"), 2, ""),
            r.stat("shards", &m("walbox_cpu_s"), 2, ""),
        );
    }
    let _ = writeln!(s);
}

fn write_cost(s: &mut String, r: &Results, scale: Scale) {
    if !r.has("writecost", "business_tps") {
        return;
    }
    let _ = writeln!(s, "### What writing an event costs the application: pgbench, 8 clients as fast as they go, {} s per way, no relay running\n", scale.curve_seconds());
    let _ = writeln!(s, "| transaction | tps | vs. business alone | mean latency | p99 latency (exact, per transaction) | WAL per transaction |");
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for (way, label) in WRITE_WAYS {
        let m = |x: &str| format!("{way}_{x}");
        let versus = if way == "business" {
            String::new()
        } else {
            r.ratio("writecost", &m("tps"), "business_tps")
                .map_or("–".into(), |x| format!("{:+.0}%", (x - 1.0) * 100.0))
        };
        let _ = writeln!(
            s,
            "| {label} | {} | {versus} | {} | {} | {} B |",
            r.stat("writecost", &m("tps"), 0, ""),
            r.stat("writecost", &m("mean_ms"), 2, " ms"),
            r.stat("writecost", &m("p99_ms"), 2, " ms"),
            r.stat("writecost", &m("wal_per_tx"), 0, ""),
        );
    }
    let _ = writeln!(s);
}

fn cleanup(s: &mut String, r: &Results) {
    if !r.has("cleanup", "events") {
        return;
    }
    let _ = writeln!(
        s,
        "### Keeping the outbox small: {} events of ~200 bytes in transactions of 100, each way on a fresh table\n",
        r.stat("cleanup", "events", 0, "")
    );
    let _ = writeln!(
        s,
        "| way | WAL per event | dead tuples left | table size left |"
    );
    let _ = writeln!(s, "|---|---|---|---|");
    for (way, label) in CLEANUP_WAYS {
        let m = |x: &str| format!("{way}_{x}");
        let _ = writeln!(
            s,
            "| {label} | {} B | {} | {} |",
            r.stat("cleanup", &m("wal_per_event"), 0, ""),
            r.stat("cleanup", &m("dead_tuples"), 0, ""),
            r.stat_scaled("cleanup", &m("table_bytes"), 1e-6, 1, " MB"),
        );
    }
    let _ = writeln!(s);
}

pub(crate) fn retention_section(r: &Results, scale: Scale) -> String {
    let mut s = heading(scale);
    let _ = writeln!(
        s,
        "### 5,000 events/s for {} s, one event per transaction, with and without retention\n",
        scale.retention_seconds()
    );
    let _ = writeln!(s, "| outbox | events acknowledged of written | commit → ack p50 | p99 | max | rows in the table: most, at the end | its largest size | dead tuples at the end | rows deleted | partitions dropped / created |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for (way, label) in RETENTION_WAYS {
        let p = format!("retention_{way}");
        if !r.has(&p, "written") {
            continue;
        }
        let _ = writeln!(
            s,
            "| {label} | {} of {} | {} | {} | {} | {}, {} | {} | {} | {} | {} / {} |",
            r.stat(&p, "acked", 0, ""),
            r.stat(&p, "written", 0, ""),
            r.stat(&p, "p50_ms", 1, " ms"),
            r.stat(&p, "p99_ms", 1, " ms"),
            r.stat(&p, "max_ms", 1, " ms"),
            r.stat(&p, "max_rows", 0, ""),
            r.stat(&p, "last_rows", 0, ""),
            r.stat(&p, "max_table_mib", 1, " MiB"),
            r.stat(&p, "dead_tuples", 0, ""),
            r.stat(&p, "rows_deleted", 0, ""),
            r.stat(&p, "partitions_dropped", 0, ""),
            r.stat(&p, "partitions_created", 0, ""),
        );
    }
    let _ = writeln!(s, "\nCommit → ack is walbox's exact histogram over every event of the run. The table's rows and size are sampled every 10 s while the writes run.\n");
    s
}

/// The audit section: what the continuous audit costs a drain, and what
/// `walbox audit` costs over every event of it.
pub(crate) fn audit_section(r: &Results, scale: Scale) -> String {
    let mut s = heading(scale);
    if !r.has("audit", "events") {
        return s;
    }
    let _ = writeln!(
        s,
        "### The continuous audit and delivery receipts: {} events of ~200 bytes in transactions of 100, drained by walbox\n",
        r.stat("audit", "events", 0, "")
    );
    let _ = writeln!(s, "| walbox run | events/s | walbox CPU µs per event | the primary's CPU µs per event (until the slot confirmed the backlog) | WAL bytes per event (the same) |");
    let _ = writeln!(s, "|---|---|---|---|---|");
    for (way, _) in AUDIT_WAYS {
        let label = match way {
            "on" => "continuous audit on (`--audit-interval 1s`)",
            "receipts" => "receipts on (`--receipts true`; until every receipt was written)",
            _ => "neither",
        };
        let _ = writeln!(
            s,
            "| {label} | {} | {} | {} | {} |",
            r.stat("audit", &format!("{way}_eps"), 0, ""),
            r.stat("audit", &format!("{way}_cpu_us"), 2, ""),
            r.stat("audit", &format!("{way}_pg_cpu_us"), 2, ""),
            r.stat("audit", &format!("{way}_wal_bytes"), 2, ""),
        );
    }
    let ratio = |way: &str| {
        r.ratio("audit", &format!("{way}_eps"), "off_eps")
            .map_or("–".into(), |x| format!("{x:.2}"))
    };
    let _ = writeln!(
        s,
        "\nAgainst neither, events/s: continuous audit **{}x**, receipts **{}x** (each way on a fresh Postgres and broker). Share of events with a receipt once the drain ended: {} (the rest dropped by a writer that fell behind, counted by `walbox_receipts_dropped_total`). The WAL is what the primary wrote while walbox drained; the receipts' table is unlogged.\n",
        ratio("on"),
        ratio("receipts"),
        r.stat("audit", "receipts_share", 3, "")
    );
    let _ = writeln!(
        s,
        "### `walbox audit` over the same {} events (walbox running, nothing missing)\n",
        r.stat("audit", "events", 0, "")
    );
    let _ = writeln!(s, "| sort memory | time | events/s | peak RSS MiB | its CPU s | the primary's CPU s | sort runs on disk |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    for (label, memory) in AUDIT_MEMORY {
        let m = |x: &str| format!("cli_{label}_{x}");
        let shown = memory.map_or("default (256 MiB)".to_owned(), |mib| {
            format!("`--memory {mib}` (MiB)")
        });
        let _ = writeln!(
            s,
            "| {shown} | {} | {} | {} | {} | {} | {} |",
            r.stat("audit", &m("s"), 2, " s"),
            r.stat("audit", &m("eps"), 0, ""),
            r.stat("audit", &m("rss_mib"), 0, ""),
            r.stat("audit", &m("cpu_s"), 2, ""),
            r.stat("audit", &m("pg_cpu_s"), 2, ""),
            r.stat("audit", &m("runs"), 0, ""),
        );
    }
    let _ = writeln!(s, "\nThe primary's CPU is every server process's while the audit ran (its one read of the window's rows, and walbox's idle walsender).\n");
    s
}

/// The brokers section: one backlog drained to each broker, beside
/// pg_recvlogical and each broker alone.
pub(crate) fn brokers_section(r: &Results, scale: Scale) -> String {
    let mut s = heading(scale);
    if !r.has("brokers", "events") {
        return s;
    }
    let _ = writeln!(
        s,
        "### {} events of ~200 bytes in transactions of 100, drained by walbox to each broker\n",
        r.stat("brokers", "events", 0, "")
    );
    let _ = writeln!(
        s,
        "pg_recvlogical reads the same backlog (to `/dev/null`) in {} ({} events/s): the slot's own limit.\n",
        r.stat("brokers", "recvlogical_s", 2, " s"),
        r.stat("brokers", "recvlogical_eps", 0, "")
    );
    let _ = writeln!(s, "| broker | walbox: until the slot confirmed every event | events/s | walbox CPU s | peak RSS | the broker alone: as many messages from walbox's client | messages/s |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    for (name, label) in BROKERS {
        let p = |m: &str| format!("{name}_{m}");
        if !r.has("brokers", &p("s")) {
            continue;
        }
        let _ = writeln!(
            s,
            "| {label} | {} | {} | {} | {} | {} | {} |",
            r.stat("brokers", &p("s"), 2, " s"),
            r.stat("brokers", &p("eps"), 0, ""),
            r.stat("brokers", &p("cpu_s"), 2, ""),
            r.stat("brokers", &p("rss_mib"), 0, " MiB"),
            r.stat("brokers", &p("alone_s"), 2, " s"),
            r.stat("brokers", &p("alone_eps"), 0, ""),
        );
    }
    let _ = writeln!(s, "\nThe broker alone: the same number of messages of ~200 bytes with the same headers and in-flight bounds (10,000 messages, 8 MiB), sent by the client walbox uses for it (sink-kafka, sink-amqp, sink-sqs, sink-nats, sink-webhook) with no Postgres and no decoding: what this broker takes on this machine through that client. Each broker's queue or topic held at least as many messages as events written when walbox was done.\n");
    s
}
