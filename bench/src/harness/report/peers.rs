//! The "walbox and Debezium" section of docs/benchmarks.md: one table per
//! backlog, the latency curve, the kill -9 duplicates, the ratios, and
//! every setting the runs used.

use std::fmt::Write;

use super::{events_per, heading, name};
use crate::peers::{
    backlog_relays, point_name, Backlog, Rows, CURVE_RELAYS, KILLED_STREAMING, KILLS, RATES, RELAYS,
};
use crate::relay::{CONNECTOR, DEBEZIUM_HEAP_MIB, DEBEZIUM_POLL_MS, JVM, WORKER};
use crate::results::Results;
use crate::Scale;

/// The phases of this section.
pub(crate) const PHASES: [&str; 6] = ["small", "large", "huge", "messages", "curve", "kill"];

pub(crate) fn section(r: &Results, scale: Scale) -> String {
    let mut s = heading(scale);
    let mut any = false;
    for b in scale.backlogs() {
        if r.has(b.phase, "events") {
            backlog(&mut s, r, b);
            any = true;
        }
    }
    if any {
        figures(
            &mut s,
            &[
                "peers-events-per-second.svg",
                "peers-cpu-per-event.svg",
                "peers-peak-rss.svg",
            ],
        );
    }
    curve(&mut s, r, scale);
    if r.has("curve", "walbox_1000_events") {
        figures(&mut s, &["peers-latency.svg"]);
    }
    kill(&mut s, r);
    if r.has("kill", "events") {
        figures(&mut s, &["peers-kill-duplicates.svg"]);
    }
    settings(&mut s);
    s
}

/// Links to the figures drawn beside the section ([`super::figures`]):
/// medians, with the range as whiskers.
fn figures(s: &mut String, files: &[&str]) {
    for f in files {
        if let Some(fig) = super::figures::ALL.iter().find(|x| x.file == *f) {
            let _ = writeln!(s, "![{}](figures/{})\n", fig.alt, fig.file);
        }
    }
}

fn backlog(s: &mut String, r: &Results, b: Backlog) {
    let p = b.phase;
    let what = match b.rows {
        Rows::Messages => "logical decoding messages (`walbox.emit()`, no table; walbox with `source = \"messages\"`)",
        Rows::Small | Rows::Large => "outbox rows",
    };
    let tx = if b.tx == b.events {
        "all in one transaction".to_owned()
    } else {
        format!("transactions of {}", b.tx)
    };
    let _ = writeln!(
        s,
        "### Backlog: {} {what} of ~{} bytes, 1,000 aggregates, {tx}\n",
        r.stat(p, "events", 0, ""),
        r.stat(p, "row_bytes", 0, "")
    );
    let _ = writeln!(s, "| relay | every event on the topic | of which before its first record | events/s | its CPU s | CPU µs per event | events per CPU-second | peak RSS MiB | walsender CPU µs per event | broker CPU µs per event | duplicates |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
    let _ = writeln!(
        s,
        "| pg_recvlogical to a pipe (the slot's own limit) | {} | | {} | | | | | {} | | |",
        r.stat(p, "recvlogical_s", 2, " s"),
        r.stat(p, "recvlogical_eps", 0, ""),
        r.stat(p, "recvlogical_walsender_us", 2, "")
    );
    for kind in backlog_relays() {
        let m = |x: &str| format!("{}_{x}", kind.slot());
        if !r.has(p, &m("s")) {
            continue;
        }
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            name(kind),
            r.stat(p, &m("s"), 2, " s"),
            r.stat(p, &m("first_s"), 2, " s"),
            r.stat(p, &m("eps"), 0, ""),
            r.stat(p, &m("cpu_s"), 2, ""),
            r.stat(p, &m("cpu_us"), 2, ""),
            r.stat(p, &m("events_per_cpu_s"), 0, ""),
            r.stat(p, &m("rss_mib"), 0, ""),
            r.stat(p, &m("walsender_us"), 2, ""),
            if r.has(p, &m("broker_us")) {
                r.stat(p, &m("broker_us"), 2, "")
            } else {
                "–".into()
            },
            r.stat(p, &m("duplicates"), 0, ""),
        );
    }
    for batch in [50, 500] {
        let m = |x: &str| format!("poll{batch}_{x}");
        if !r.has(p, &m("s")) {
            continue;
        }
        let _ = writeln!(
            s,
            "| polling relay, batch {batch} (a copy of the rows; its own run time) | {} | | {} | {} | {} | {} | {} | | | 0 |",
            r.stat(p, &m("s"), 2, " s"),
            r.stat(p, &m("eps"), 0, ""),
            r.stat(p, &m("cpu_s"), 2, ""),
            r.stat(p, &m("cpu_us"), 2, ""),
            events_per(r, p, &m("cpu_us")),
            r.stat(p, &m("rss_mib"), 0, ""),
        );
    }
    let started: Vec<_> = backlog_relays()
        .filter(|k| r.has(p, &format!("{}_startup_s", k.slot())))
        .collect();
    if !started.is_empty() {
        let _ = writeln!(s, "\nStart-up, not in the figures above: each relay launched cold, from its launch until the events waiting for it (one per relay launched before it, and its own) were on its topic.\n");
        let _ = writeln!(
            s,
            "| relay | launch → its first events on the topic | its CPU s until then |"
        );
        let _ = writeln!(s, "|---|---|---|");
        for kind in started {
            let m = |x: &str| format!("{}_{x}", kind.slot());
            let _ = writeln!(
                s,
                "| {} | {} | {} |",
                name(kind),
                r.stat(p, &m("startup_s"), 2, " s"),
                r.stat(p, &m("startup_cpu_s"), 2, ""),
            );
        }
    }
    let _ = writeln!(s, "\nWhat reading the backlog cost the primary, per event: the CPU of the server process serving the reader (its walsender, from its pause, so what it decoded ahead while the backlog was written counts; the poller's backend) and of all the server's processes during the drain plus that walsender's decoding ahead (less the harness's own session); statements that scanned the outbox table, rows written to it and the dead tuples left; WAL written meanwhile, by anyone.\n");
    let _ = writeln!(s, "| reader | serving process, CPU µs per event | all server processes, CPU µs per event | scans of the outbox table | rows written to it (dead tuples left) | WAL bytes per event |");
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    let _ = writeln!(
        s,
        "| pg_recvlogical | {} | {} | 0 | 0 | 0 |",
        r.stat(p, "recvlogical_walsender_us", 2, ""),
        r.stat(p, "recvlogical_pg_us", 2, "")
    );
    let readers: Vec<(String, String, String)> = RELAYS
        .iter()
        .map(|k| (name(*k), k.slot(), format!("{}_walsender_us", k.slot())))
        .chain([50, 500].map(|b| {
            (
                format!("polling relay, batch {b}"),
                format!("poll{b}"),
                format!("poll{b}_backend_us"),
            )
        }))
        .collect();
    for (label, key, serving) in readers {
        let m = |x: &str| format!("{key}_{x}");
        if !r.has(p, &m("pg_us")) {
            continue;
        }
        let _ = writeln!(
            s,
            "| {label} | {} | {} | {} | {} ({}) | {} |",
            r.stat(p, &serving, 2, ""),
            r.stat(p, &m("pg_us"), 2, ""),
            r.stat(p, &m("outbox_scans"), 0, ""),
            r.stat(p, &m("outbox_rows_written"), 0, ""),
            r.stat(p, &m("dead_tuples"), 0, ""),
            r.stat(p, &m("wal_per_event"), 1, ""),
        );
    }
    let ratio = |a: &str, b: &str| r.ratio(p, a, b).map_or("–".into(), |x| format!("{x:.2}"));
    let _ = writeln!(s);
    if r.has(p, "debezium_s") {
        let _ = write!(
            s,
            "walbox / Debezium: events/s **{}x**; events per CPU-second **{}x** (target ≥ 3x); peak RSS **1/{}** (target ≤ 1/20); walsender CPU per event {}x. ",
            ratio("walbox_eps", "debezium_eps"),
            ratio("walbox_events_per_cpu_s", "debezium_events_per_cpu_s"),
            r.ratio(p, "debezium_rss_mib", "walbox_rss_mib")
                .map_or("–".into(), |x| format!("{x:.0}")),
            ratio("walbox_walsender_us", "debezium_walsender_us"),
        );
    }
    let _ = write!(
        s,
        "walbox / pg_recvlogical: **{}x** (target ≥ 1.0x). ",
        ratio("walbox_eps", "recvlogical_eps")
    );
    if let Some(x) = [50, 500]
        .iter()
        .filter_map(|b| r.ratio(p, "walbox_eps", &format!("poll{b}_eps")))
        .reduce(f64::min)
    {
        let _ = write!(s, "walbox / the better polling relay: {x:.2}x. ");
    }
    let _ = writeln!(
        s,
        "walbox's slot confirmed the backlog's end after {}.",
        r.stat(p, "walbox_confirmed_s", 2, " s"),
    );
    let ahead: Vec<String> = [("pg_recvlogical".to_owned(), "recvlogical".to_owned())]
        .into_iter()
        .chain(backlog_relays().map(|k| (name(k), k.slot())))
        .filter(|(_, key)| r.has(p, &format!("{key}_ahead")))
        .map(|(label, key)| {
            format!(
                "{label} {}",
                r.stat_scaled(p, &format!("{key}_ahead"), 100.0, 1, "%")
            )
        })
        .collect();
    if !ahead.is_empty() {
        let _ = write!(
            s,
            " Share of the backlog's WAL each walsender had decoded, into its paused reader's socket, before the clock started: {}.",
            ahead.join("; ")
        );
    }
    let _ = writeln!(s, "\n");
}

fn curve(s: &mut String, r: &Results, scale: Scale) {
    if !r.has("curve", "walbox_1000_events") {
        return;
    }
    let _ = writeln!(
        s,
        "### Latency: commit → on the topic, exact over every event, {} s per point after a 5 s warm-up\n",
        scale.curve_seconds()
    );
    let _ = writeln!(s, "| asked rate (pgbench, 8 clients, one event per transaction) | relay | events/s written | p50 | p99 | p99.9 | max | relay CPU µs per event | broker CPU µs per event |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    for rate in RATES {
        let point = point_name(rate);
        for kind in CURVE_RELAYS {
            let k = |m: &str| format!("{}_{point}_{m}", kind.slot());
            if !r.has("curve", &k("events")) {
                continue;
            }
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                rate.map_or("as fast as pgbench writes".into(), |r| format!("{r}/s")),
                name(kind),
                r.stat("curve", &k("eps"), 0, ""),
                r.stat("curve", &k("p50_ms"), 0, " ms"),
                r.stat("curve", &k("p99_ms"), 0, " ms"),
                r.stat("curve", &k("p999_ms"), 0, " ms"),
                r.stat("curve", &k("max_ms"), 0, " ms"),
                r.stat("curve", &k("cpu_us"), 2, ""),
                if r.has("curve", &k("broker_us")) {
                    r.stat("curve", &k("broker_us"), 2, "")
                } else {
                    "–".into()
                },
            );
        }
    }
    let _ = writeln!(s, "\nThe commit's time is Postgres's commit timestamp (`track_commit_timestamp = on`, µs); on the topic is the broker's append time (`message.timestamp.type = LogAppendTime`, whole ms), so each latency is exact to within 1 ms. Both include the commit's WAL flush.\n");
    if !r.has("curve", "walbox_1000_read_p99_ms") {
        return;
    }
    let _ = writeln!(s, "Where walbox's part of it goes: its own exact histograms over every event of the point (a walbox process per point, logged as it stops): from the commit to walbox reading the transaction's end from the slot (Postgres: the WAL flush, the walsender's decoding, the network), and to the broker's acknowledgement (walbox, librdkafka's batching, the broker's append and replication). The difference of the two p99s is a bound on walbox's and the broker's share of the tail, not an exact split (the percentiles of a sum are not sums of percentiles).\n");
    let _ = writeln!(s, "From reading an event to handling its acknowledgement, walbox splits each event's time exactly: librdkafka's part (its latency from `produce()` to the delivery report, by its own clock: its queue, the `linger.ms`, the broker's append and answer) and the rest, walbox's own (mapping, waiting for room in flight, the hand-over, the report's way back to the relay). Per event, so these percentiles are of the parts themselves.\n");
    let _ = writeln!(s, "| asked rate | commit → read p50 | commit → read p99 | commit → ack p50 | commit → ack p99 | walbox's own p50 | walbox's own p99 | librdkafka's p50 | librdkafka's p99 |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    for rate in RATES {
        let k = |m: &str| format!("walbox_{}_{m}", point_name(rate));
        if !r.has("curve", &k("read_p99_ms")) {
            continue;
        }
        let part = |m: &str| {
            if r.has("curve", &k(m)) {
                r.stat("curve", &k(m), 2, " ms")
            } else {
                "–".into()
            }
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            rate.map_or("as fast as pgbench writes".into(), |r| format!("{r}/s")),
            r.stat("curve", &k("read_p50_ms"), 1, " ms"),
            r.stat("curve", &k("read_p99_ms"), 1, " ms"),
            r.stat("curve", &k("ack_p50_ms"), 1, " ms"),
            r.stat("curve", &k("ack_p99_ms"), 1, " ms"),
            part("own_p50_ms"),
            part("own_p99_ms"),
            part("client_p50_ms"),
            part("client_p99_ms"),
        );
    }
    let _ = writeln!(s);
}

fn kill(s: &mut String, r: &Results) {
    if !r.has("kill", "events") {
        return;
    }
    let _ = writeln!(
        s,
        "### kill -9 at a random point of a backlog of {} events of ~200 bytes, then a restart ({KILLS} or more kills per relay over the runs)\n",
        r.stat("kill", "events", 0, "")
    );
    let _ = writeln!(
        s,
        "| relay | kills | records on the topic when killed | duplicates per kill | each kill's duplicates, sorted | missing |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for kind in RELAYS.into_iter().chain([KILLED_STREAMING]) {
        let k = |m: &str| format!("{}_{m}", kind.slot());
        let each = r.all("kill", &k("duplicates"));
        if each.is_empty() {
            continue;
        }
        let label = if kind == KILLED_STREAMING {
            format!(
                "{}, killed {} s into a stream of 2,000 events/s",
                kind.label(),
                r.stat("kill", "streaming_kill_after_s", 0, "")
            )
        } else {
            kind.label()
        };
        let _ = writeln!(
            s,
            "| {label} | {} | {} | {} | {} | 0 (every event id read back) |",
            each.len(),
            r.stat("kill", &k("at"), 0, ""),
            r.stat("kill", &k("duplicates"), 0, ""),
            each.iter()
                .map(|d| format!("{d:.0}"))
                .collect::<Vec<_>>()
                .join(", "),
        );
    }
    let _ = writeln!(s, "\nEach relay is warm when killed: launched, warmed up, and paused while the backlog is written; the kill point is drawn uniformly between a tenth and nine tenths of the backlog. walbox confirms the slot's position as the broker acknowledges, and a restart reads its topics back and skips what is there (`skip_delivered`); Debezium's position is its Connect offset, flushed every `offset.flush.interval.ms`: a restart resends what came after the last flush. Debezium with Connect's default 60 s flush is killed only after more than 60 s of streaming (killed earlier it would resend everything, an artifact of the kill's timing).\n");
}

fn settings(s: &mut String) {
    let kv = |p: &[(&str, &str)]| {
        p.iter()
            .map(|(k, v)| format!("`{k}={v}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(s, "#### Settings\n");
    let _ = writeln!(s, "- Postgres: a private server, `fsync = on`, `full_page_writes = on`, `synchronous_commit = on`, `shared_buffers = 256MB`, `max_wal_size = 4GB`, `track_commit_timestamp = on`; one publication, `walbox_outbox` (made by `walbox init-slot`), read by every relay, each from its own pgoutput slot.");
    let _ = writeln!(s, "- Apache Kafka: one KRaft node (broker and controller), in-process defaults; topics of 3 partitions, `message.timestamp.type = LogAppendTime`.");
    let _ = writeln!(s, "- walbox: its defaults (`acks=all`, `enable.idempotence=true`, `compression.type=lz4`, `linger.ms=1`, `partitioner=murmur2_random`, librdkafka's `batch.size` of 1,000,000 bytes), `WALBOX_LOG=warn`, topic template `walbox.{{aggregate_type}}`.");
    let _ = writeln!(s, "- Debezium: the Postgres connector and its outbox EventRouter in a Kafka Connect standalone worker (plain `java`, offsets in a file): Connect standalone is how the EventRouter is documented and most often deployed; Debezium Server runs the same connector, router and Kafka producer. JVM as `connect-standalone.sh` starts it: {} `-Xmx{}M` (beside it in the small backlog with `-Xmx512M` and `-Xmx256M`). Worker: `key.converter` and `value.converter` StringConverter (the record walbox writes), {}, `offset.flush.interval.ms` 1000 (walbox's `status_interval_ms`; 60000, Connect's default, in the kill phase too). Connector: `plugin.name=pgoutput`, `snapshot.mode=no_data`, {}, `poll.interval.ms={}` (in the latency curve also 1), route `{{slot}}.${{routedByValue}}`.", JVM.iter().map(|a| format!("`{a}`")).collect::<Vec<_>>().join(" "), DEBEZIUM_HEAP_MIB, kv(WORKER), kv(CONNECTOR), DEBEZIUM_POLL_MS);
    let _ = writeln!(s, "- The polling relay ([bench/src/bin/outbox-poller.rs](../bench/src/bin/outbox-poller.rs)): in one transaction `SELECT … WHERE published_at IS NULL ORDER BY seq LIMIT n FOR UPDATE SKIP LOCKED`, produce the rows with walbox's producer settings and wait for every ack, `UPDATE … SET published_at = now()`, `COMMIT`; prepared statements, a partial index on the unpublished rows, batch 50 and 500, on a copy of the backlog's rows (vacuumed and checkpointed first). Its time is its own run's, from its first poll.");
    let _ = writeln!(s, "- Warm relays: in the backlogs and the kills each relay is launched (its start-up timed on its own), warmed up with a tenth of the backlog (at most 50,000 events), and paused (SIGSTOP) while the backlog is written; the clock starts at SIGCONT. pg_recvlogical is started and paused the same way, writing to a pipe the harness reads until the backlog's last event. The walsender of a paused reader decodes ahead until its socket is full, as it would for a reader that is busy; `wal_sender_timeout = 0` keeps the paused readers' connections.");
    let _ = writeln!(s, "- Measured from `/proc`: each relay's CPU (all threads, user + system, from SIGCONT until every event was on the topic) and peak RSS (`VmHWM`, over its life, the warm-up included); the walsender's CPU likewise. \"Every event on the topic\" is when the topic's end offsets reached the backlog (checked every 20 ms); the records are then read back and every event id counted.");
}
